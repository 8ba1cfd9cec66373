"""The largest model that trains at a fixed per-rank memory cap (issue 30): level 3 of a
model built under ``tnt.deferred_variables()`` against plain data parallelism (level 0,
eager build), on 4 ranks.

    python benchmarks/sharded_cap.py [--cap-mib 1536] [--layers 8] [--ranks 4]

Model: ``Dense(W)`` x ``layers`` on a W-wide input (Psi = layers * (W^2 + W)), Adam,
float32, one fit of 2 steps (global batch 16) on synthetic data. Every rank (and the
launcher) runs under ``prlimit --data=<cap>``: private data beyond the cap fails to
allocate, and the job fails. For each level the width is searched: doubled from
``--start`` while the fit succeeds (halved while it fails), then bisected (multiples of ``--step``) between the
last width that trained and the first that failed. Row
``shard3_largest_model_vs_dp_4ranks_cap``: largest Psi at level 3 / largest Psi at level 0
(no target given: reported). Each launch's outcome is printed as it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
import benchlib as bl  # noqa: E402  (pins threads before TensorFlow)

GLOBAL_BATCH, STEPS = 16, 2


def params(width: int, layers: int) -> int:
    return layers * (width * width + width)


def worker(level: int, width: int, layers: int) -> None:
    """One rank: build (deferred at level 3), wrap, one short fit; report VmHWM."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tarantella as tnt

    bl.pin_threads(tf)

    def build() -> keras.Model:
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((width,))]
                                + [keras.layers.Dense(width, activation="relu") for _ in range(layers)])

    if level == 3:
        with tnt.deferred_variables():  # no rank holds the whole model, not even to build it
            model = build()
    else:
        model = build()
    tm = tnt.Model(model, sharding=level)
    tm.compile(keras.optimizers.Adam(1e-4), "mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, width)).astype("float32")
    tm.fit(x, x, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    hwm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    bl.emit({"rank": tnt.get_rank(), "vmhwm": hwm})


def launch(level: int, width: int, layers: int, ranks: int, cap: int, timeout: float) -> dict:
    """One capped job; its outcome (ok, seconds, the ranks' VmHWM, the last error line)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    launcher = str(Path(sys.executable).parent / "tarantella")
    cmd = ["prlimit", f"--data={cap}", launcher, "-n", str(ranks), "--python-interpreter", sys.executable,
           "--", str(HERE), "--worker", str(level), "--width", str(width), "--layers", str(layers)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        ok, out, err = p.returncode == 0, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:  # counted as not trained
        ok, out, err = False, str(e.stdout or ""), f"timeout after {timeout:.0f} s"
    res = {"level": level, "width": width, "params": params(width, layers), "ok": ok,
           "seconds": round(time.perf_counter() - t0, 1),
           "vmhwm_mib": [round(r["vmhwm"] / 2**20) for r in bl.parse_results(out)] if ok else None}
    if not ok:
        lines = ([ln for ln in err.splitlines() if "Error" in ln or "bad_alloc" in ln or "Killed" in ln]
                 or err.strip().splitlines()[-1:])
        res["error"] = (lines or [""])[-1][:200]
    print(json.dumps(res), flush=True)
    return res


def largest(level: int, layers: int, ranks: int, cap: int, start: int, step: int, launches: int,
            timeout: float, bracket: tuple[int, int] | None = None) -> tuple[int | None, list[dict]]:
    """The widest W (a multiple of ``step``) whose capped fit succeeded, within ``launches``;
    ``bracket``: (a width that trained, one that failed) of an earlier run, bisected on."""
    tried: list[dict] = []
    good, bad, w = None, None, start
    if bracket is not None:
        good, bad = bracket
        w = (good + bad) // 2 // step * step
        if w <= good:
            return good, tried
    while len(tried) < launches:
        r = launch(level, w, layers, ranks, cap, timeout)
        tried.append(r)
        if r["ok"]:
            good = w
        else:
            bad = w
        if bad is None:
            w *= 2
        elif good is None:
            w //= 2
            if w < step:
                break
        else:
            w = (good + bad) // 2 // step * step
            if w <= good:
                break
    return good, tried


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap-mib", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--start", default="2048,4096",
                    help="first width tried at levels 0,3 (doubled or halved, then bisected)")
    ap.add_argument("--step", type=int, default=128, help="widths are multiples of this")
    ap.add_argument("--launches", type=int, default=5, help="launches per level")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per launch")
    ap.add_argument("--quick", action="store_true", help="3 launches per level")
    ap.add_argument("--bracket", default="",
                    help="resume: 'good:bad,good:bad' widths of levels 0,3 from an earlier run, bisected on")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.width, args.layers)
        return 0
    cap = args.cap_mib * 2**20
    launches = 3 if args.quick else args.launches
    machine = bl.machine()
    found, runs = {}, {}
    brackets = [tuple(int(w) for w in b.split(":")) for b in args.bracket.split(",")] if args.bracket else None
    for level in (0, 3):
        start = dict(zip((0, 3), (int(w) for w in args.start.split(","))))[level]
        found[level], runs[level] = largest(level, args.layers, args.ranks, cap, start, args.step,
                                            launches, args.timeout, brackets[(0, 3).index(level)] if brackets else None)
    if found[0] is None or found[3] is None:
        print(f"no width trained under the cap at some level: {found}", file=sys.stderr)
        return 1
    p0, p3 = params(found[0], args.layers), params(found[3], args.layers)
    upper = {lv: min([r["width"] for r in runs[lv] if not r["ok"]]
                     + ([brackets[(0, 3).index(lv)][1]] if brackets else []), default=None) for lv in (0, 3)}
    row = {"name": f"shard3_largest_model_vs_dp_{args.ranks}ranks_cap", "value": p3 / p0, "target": None,
           "higher_is_better": True, "unit": "x level 0's largest parameters",
           "detail": f"prlimit --data={args.cap_mib} MiB per rank, Dense(W) x {args.layers}, Adam, "
                     f"{args.ranks} ranks: level 3 (deferred build) W = {found[3]} ({p3 / 1e6:.1f} M; "
                     f"W = {upper[3]} failed) vs level 0 (eager) W = {found[0]} ({p0 / 1e6:.1f} M; "
                     f"W = {upper[0]} failed)"}
    print(f"{row['name']:40} {row['value']:.3f}  (target {row['target']})  {row['detail']}")
    bl.RESULTS.mkdir(exist_ok=True)
    (bl.RESULTS / "sharded_cap.json").write_text(json.dumps(
        {"cap_mib": args.cap_mib, "layers": args.layers, "ranks": args.ranks, "largest_width": found,
         "runs": runs, "machine_before": machine, "rows": [row]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
