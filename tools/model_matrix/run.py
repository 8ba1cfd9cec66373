"""Writes docs/models.md: keras-hub and keras.applications models by strategies, each cell
measured by launching tools/model_matrix/cell.py (one job per cell, with a time limit).

    python tools/model_matrix/run.py [--models NAME ...] [--strategies DATA ...]
    python tools/model_matrix/run.py --models llama,gemma,mobilenet --strategies TENSOR

A full run measures every model under every strategy (about 40 min of CPU). With
``--models`` or ``--strategies`` only those cells are measured and merged into the
existing results (``--json``): the other rows and cells are kept as they were, and the
page is written from the merged table. A model is named by its row's name or any
case-insensitive part of it (``llama`` for "LlamaBackbone + head"); names may be
separated by commas or spaces.

Run it with the Python that has tarantella and keras-hub (e.g. .nox/keras/bin/python).
A cell is "exact" when History, the saved weights (file opened in plain Keras) and the
predictions are within the suite's float32 tolerances of serial Keras, "differs" with the
largest difference otherwise, and "fails" with the first line of the error a user sees.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CELL = Path(__file__).with_name("cell.py")
TOL = 2e-5  # tests/test_real_models.py: float32 summation order

sys.path.insert(0, str(Path(__file__).parent))


def _launcher() -> str:
    return str(Path(sys.executable).with_name("tarantella"))


def run_cell(model: str, strategy: str, ranks: int, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cell.json"
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_DETERMINISTIC_OPS="1", OMP_NUM_THREADS="1",
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [_launcher(), "-n", str(ranks), "--python-interpreter", sys.executable, "--",
               str(CELL), "--model", model, "--strategy", strategy, "--out", str(out)]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"no result after {timeout} s", "seconds": timeout}
        seconds = round(time.monotonic() - start, 1)
        if out.exists():
            return {**json.loads(out.read_text()), "seconds": seconds}
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln]
        return {"status": "crash", "error": (errors[-1] if errors else f"exit {proc.returncode}")[:300],
                "seconds": seconds}


def verdict(cell: dict) -> str:
    if cell["status"] != "ran":
        return f"**fails**: `{cell['error'].replace('|', '/')}`"
    problems = []
    if not cell["history_keys_equal"]:
        problems.append(f"History keys {cell['history_keys']}")
    counts = cell["weight_count"]
    if counts[0] != counts[1]:
        problems.append(f"saved file holds {counts[1]} weights, serial {counts[0]}")
    worst = max(v for v in (cell["history_diff"], cell["weight_diff"] or 0.0, cell["predict_diff"],
                            cell["saved_predict_diff"]))
    if worst > TOL:
        problems.append(f"differs by up to {worst:.1e}")
    if problems:
        return "**differs**: " + "; ".join(problems)
    return f"exact ({worst:.0e})"


def select(names: list[str], known: list[str], what: str) -> list[str]:
    """The ``known`` names that ``names`` pick (exactly, or by a case-insensitive part), in
    ``known``'s order; a SystemExit naming the known ones for a name that picks none."""
    wanted = [n.strip() for arg in names for n in arg.split(",") if n.strip()]
    picked = set()
    for name in wanted:
        hits = [k for k in known if k == name] or [k for k in known if name.lower() in k.lower()]
        if not hits:
            raise SystemExit(f"no {what} matches {name!r}; known: {', '.join(known)}")
        picked.update(hits)
    return [k for k in known if k in picked]


def merged(old: dict, new: dict, models: list[str], strategies: list[str]) -> dict:
    """``old`` with ``new``'s cells replacing or adding theirs: rows in ``models`` order
    (the known models first, then rows only ``old`` has), cells in ``strategies`` order."""
    table = {m: dict(old.get(m, {})) for m in [*models, *(m for m in old if m not in models)]}
    for model, row in new.items():
        table[model].update(row)
    return {m: {s: row[s] for s in strategies if s in row} for m, row in table.items() if row}


def write_page(table: dict, strategies: list[str], ranks: dict) -> str:
    today = datetime.date.today().isoformat()
    head = "| model | " + " | ".join(f"{s} ({ranks[s]} ranks)" for s in strategies) + " |"
    lines = [
        "# Models users train, under every strategy",
        "",
        "Each cell trains the model with `tnt.Model` (Adam, 2 epochs of 4 global batches of 8) and",
        "serial Keras from the same initial weights in the same job, saves the tnt model, opens",
        "the file in plain Keras and compares History, the saved weights and the predictions.",
        f"*exact* means every difference ≤ {TOL:g} (float32 summation order; the figure is the",
        "largest; per array, relative to its largest magnitude when that is above 1, as batch",
        "normalisation's moving variances are); *differs* names what differs; *fails* quotes",
        "the error a user sees.",
        "Models are built from constructor arguments (tiny sizes, no downloads): see",
        "`tools/model_matrix/cell.py`. PIPELINING: 2 stages, automatic partition, 4 micro-batches;",
        "TENSOR: `tensor_parallel_size=2`; ALL: 2 stages by 2 shards. The CNNs run without",
        "dropout and, under DATA, with `sync_batch_norm=True` (batch statistics of the global",
        "batch, as serial Keras); the other strategies have no such option: pipelining's",
        "micro-batches normalise over their own rows.",
        "",
        f"Generated by `python tools/model_matrix/run.py` on {today}; do not edit by hand.",
        "",
        head,
        "|---|" + "---|" * len(strategies),
    ]
    for model, row in table.items():
        lines.append(f"| {model} | " + " | ".join(verdict(row[s]) if s in row else "not measured"
                                                  for s in strategies) + " |")
    lines += [
        "",
        "Reading the CNN rows: under DATA (synchronised batch normalisation) and TENSOR (each",
        "rank of the group computes on the whole batch) History and the",
        "predictions agree with serial Keras within 7e-6; the weights differ by up to 5e-4",
        "relative. Adam divides each update by the root of its second moment, so weights whose",
        "gradients are near zero move by a full step in the direction of float32 rounding",
        "noise, and the summation order differs (global moments gathered over ranks; a",
        "different op fusion). PIPELINING and ALL normalise each micro-batch over its own",
        "rows (4 micro-batches of 2 here), which is a different model than the serial one:",
        "use `num_micro_batches=1`, or a model without batch normalisation, for the serial",
        "result.",
        "",
        "Where the CNN difference comes from (MobileNetV3Small, minimalistic, 64x64 images, 2",
        "steps of 8, DATA with `sync_batch_norm=True` on 2 ranks, against serial Keras in the same",
        "job): with SGD(0.01) History differs by 1.2e-7, the weights by 3.3e-7 (relative) and the",
        "predictions by 3e-8: exact, and closer to serial float32 than serial float64 is (History",
        "6e-7 apart). With Adam(1e-3): History 1.4e-5, weights 1.4e-3 relative (0.1 % of the",
        "elements beyond 2e-5), predictions 7e-7, while serial Keras in float32 is itself 1.5e-3",
        "(weights, relative) and 3.6e-6 (History) away from serial Keras in float64: tnt's",
        "weights differ from serial by as much as float32 itself does (History: 4 times as much).",
        "The synchronised statistics are",
        "sums per rank, then over the ranks: another float32 summation order than serial Keras'",
        "one `reduce_mean` over the batch, a 1e-7 difference that SGD carries as 1e-7 and Adam",
        "turns into a full step wherever a gradient is near zero. Smaller shapes amplify it even",
        "with SGD: at 32x32 (1x1 last feature maps) Adam gave History 1e-4 apart and SGD, at",
        "width 0.25, 6e-2 by the second epoch; at 64x64, width 0.25, with an uneven last batch,",
        "SGD gave 2e-3 (momentum 0.9: History 2e-7 but weights 1.2e-4).",
        "",
        "What the suite checks: `packages/tnt-keras/tests/jobs/real_models.py` (the shared",
        "2-rank launch) trains MobileNetV3Small (minimalistic, 64x64, 16 images, one epoch of 2",
        "even steps of 8, SGD(0.01)) under DATA with `sync_batch_norm=True` against serial Keras",
        "in the same job, and asserts History within 1e-5, the weights within 2e-5 (relative, as",
        "above) and the predictions within 2e-5 (measured: 7e-7, 2.5e-7, 3e-8). Adam, the",
        "other strategies and the smaller shapes are not asserted equal, for the reasons above.",
    ]
    lines += ["", "Seconds per cell (launch included):", ""]
    lines.append(head)
    lines.append("|---|" + "---:|" * len(strategies))
    for model, row in table.items():
        lines.append(f"| {model} | " + " | ".join(str(row.get(s, {}).get("seconds", "")) for s in strategies) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import cell  # the model and strategy lists, one place

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=[],
                        help="rows to measure (names or parts of them; default: all), merged into --json")
    parser.add_argument("--strategies", nargs="*", default=[],
                        help="columns to measure (default: all), merged into --json")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    parser.add_argument("--json", default=str(ROOT / "tools" / "model_matrix" / "results.json"))
    parser.add_argument("--from-json", action="store_true", help="write the page from --json without running")
    args = parser.parse_args()
    all_strategies = list(cell.STRATEGIES)
    ranks = {s: cell.STRATEGIES[s][0] for s in all_strategies}
    json_path = Path(args.json)
    if args.from_json:
        table = json.loads(json_path.read_text())
        Path(args.out).write_text(write_page(table, [s for s in all_strategies if any(s in r for r in table.values())],
                                             ranks))
        return
    models = select(args.models, list(cell.MODELS), "model") if args.models else list(cell.MODELS)
    strategies = select(args.strategies, all_strategies, "strategy") if args.strategies else all_strategies
    partial = bool(args.models or args.strategies)
    new: dict = {}
    for model in models:
        new[model] = {}
        for strategy in strategies:
            new[model][strategy] = run_cell(model, strategy, ranks[strategy], args.timeout)
            print(f"{model:22} {strategy:10} {verdict(new[model][strategy])}", flush=True)
    old = json.loads(json_path.read_text()) if partial and json_path.exists() else {}
    table = merged(old, new, list(cell.MODELS), all_strategies)
    json_path.write_text(json.dumps(table, indent=1, default=str))
    shown = [s for s in all_strategies if any(s in row for row in table.values())]
    Path(args.out).write_text(write_page(table, shown, ranks))


if __name__ == "__main__":
    main()
