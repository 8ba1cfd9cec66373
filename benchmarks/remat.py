"""Stage recomputation (``remat="stages"``, issue 29): activation memory saved, time paid.

    python benchmarks/remat.py            (run_all.py: remat; launches its own 2-rank jobs)
    python benchmarks/remat.py --only act_gpipe,act_gpipe_remat   (the issue's rows alone)

An activation-heavy MLP (512 -> 12 x Dense(512, relu) -> 10; 3.2 M parameters), Adam, global
batch 8192 in m = 8 micro-batches of 1024 rows, 3 steps, PIPELINING p = 2, built under
``tnt.deferred_variables()``. Each configuration (GPipe and 1F1B, each with and without
``remat="stages"``) runs in a launch of its own, so no other configuration's pages are in
its figures. A rank's peak is getrusage's max RSS at the end of ``fit`` minus its RSS right
after ``import tensorflow, tarantella`` (as benchmarks/memory.py measures); its step time
is the median of the steps after the first (which traces).

Rows (results/remat.json -> summary.json):

- remat_peak_memory_vs_kept_gpipe_p2 / ..._1f1b_p2: the largest stage's measured peak with
  recomputation over without (lower is better; no target: the issue asks for the figure)
- remat_step_time_vs_kept_gpipe_p2 / ..._1f1b_p2: median step time with over without (the
  price: one more forward pass per micro-batch, ideally about 4/3)

The issue's rows are measured on a model whose activations dominate its memory (the model
above keeps ~25 MiB of activations per micro-batch and stage beside ~200 MiB of runtime, data
and state, so its ratio says more about that fixed part than about recomputation): an MLP
512 -> 48 x Dense(512, relu) -> 10 (12.6 M parameters), global batch 32768 in m = 8
micro-batches of 4096 rows, GPipe (which keeps all m micro-batches' activations), p = 2.
(At 24 layers and batch 16384 a stage kept ~52 MiB per micro-batch beside ~470 MiB of the
rest, measured: 884 -> 555 MiB, 0.63; the activations were not the larger part.)

- remat_activation_saving_p2_m8: the largest stage's measured peak with ``remat="stages"``
  over the same run keeping activations (target <= 0.5)
- remat_step_time_cost_p2_m8: its median step time over the kept run's (target <= 1.35)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib  # light: no TensorFlow, no MPI at import
from memory import max_rss, rss

HERE = Path(__file__).parent
RESULTS = HERE / "results"
IN, WIDTH, DEPTH, CLASSES = 512, 512, 12, 10
GLOBAL_BATCH, MICRO, STEPS = 8192, 8, 3

#: The activation-dominated model of the issue's rows: depth, global batch.
ACT_DEPTH, ACT_BATCH = 48, 32768

#: name -> (schedule, remat, depth, global batch)
CONFIGS: dict[str, tuple[str, str | None, int, int]] = {
    "gpipe": ("gpipe", None, DEPTH, GLOBAL_BATCH), "gpipe_remat": ("gpipe", "stages", DEPTH, GLOBAL_BATCH),
    "1f1b": ("1f1b", None, DEPTH, GLOBAL_BATCH), "1f1b_remat": ("1f1b", "stages", DEPTH, GLOBAL_BATCH),
    "act_gpipe": ("gpipe", None, ACT_DEPTH, ACT_BATCH), "act_gpipe_remat": ("gpipe", "stages", ACT_DEPTH, ACT_BATCH),
}


def worker(config: str, out: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np

    import tarantella as tnt

    baseline = rss()
    import keras

    schedule, remat, depth, batch = CONFIGS[config]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * STEPS, IN), dtype=np.float32)
    y = rng.integers(0, CLASSES, batch * STEPS)
    keras.utils.set_random_seed(0)
    with tnt.deferred_variables():
        inputs = keras.Input((IN,))
        h = inputs
        for _ in range(depth):
            h = keras.layers.Dense(WIDTH, activation="relu")(h)
        model = keras.Model(inputs, keras.layers.Dense(CLASSES)(h))
    model = tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_pipeline_stages=2,
                      num_micro_batches=MICRO, pipeline_schedule=schedule, remat=remat)
    model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    times: list[float] = []
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
              callbacks=[benchlib.step_times(keras, times)])
    record = {"config": config, "rank": tnt.get_rank(), "peak_bytes": max_rss() - baseline,
              "step_seconds": times, "median_step_seconds": statistics.median(times[1:])}
    Path(f"{out}.{record['rank']}.json").write_text(json.dumps(record, indent=1))


def launch(config: str, tmp: Path) -> list[dict]:
    out = tmp / config
    run = [sys.executable, str(Path(__file__).resolve()), "--worker", config, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    subprocess.run([benchlib.mpirun(), "--oversubscribe", "--bind-to", "none", "-n", "2", *run],
                   env=env, check=True, timeout=1200)
    records = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    print(f"{config}: " + ", ".join(f"stage {r['rank']} peak {r['peak_bytes'] / 2**20:.0f} MiB, "
                                    f"step {r['median_step_seconds'] * 1e3:.0f} ms" for r in records), flush=True)
    return records


def rows(res: dict[str, list[dict]]) -> list[dict]:
    mib, out = 2**20, []
    for schedule in ("gpipe", "1f1b"):
        if schedule not in res or f"{schedule}_remat" not in res:
            continue  # --only left the pair out
        kept, remat = res[schedule], res[f"{schedule}_remat"]
        top_k, top_r = max(r["peak_bytes"] for r in kept), max(r["peak_bytes"] for r in remat)
        step_k = max(r["median_step_seconds"] for r in kept)
        step_r = max(r["median_step_seconds"] for r in remat)
        per = ", ".join(f"stage {r['rank']} {k['peak_bytes'] / mib:.0f} -> {r['peak_bytes'] / mib:.0f} MiB"
                        for k, r in zip(kept, remat))
        out.append({"name": f"remat_peak_memory_vs_kept_{schedule}_p2", "value": top_r / top_k, "target": None,
                    "higher_is_better": False, "unit": "x the same run keeping activations (max RSS - RSS after imports)",
                    "detail": f"PIPELINING p = 2, m = {MICRO}, {schedule}, batch {GLOBAL_BATCH}: {per} (remat.py)"})
        out.append({"name": f"remat_step_time_vs_kept_{schedule}_p2", "value": step_r / step_k, "target": None,
                    "higher_is_better": False, "unit": "x median step time keeping activations",
                    "detail": f"{step_k * 1e3:.0f} -> {step_r * 1e3:.0f} ms per step, slower stage (remat.py)"})
    if "act_gpipe" not in res or "act_gpipe_remat" not in res:
        return out
    kept, remat = res["act_gpipe"], res["act_gpipe_remat"]
    top_k, top_r = max(r["peak_bytes"] for r in kept), max(r["peak_bytes"] for r in remat)
    step_k = max(r["median_step_seconds"] for r in kept)
    step_r = max(r["median_step_seconds"] for r in remat)
    per = ", ".join(f"stage {r['rank']} {k['peak_bytes'] / mib:.0f} -> {r['peak_bytes'] / mib:.0f} MiB"
                    for k, r in zip(kept, remat))
    model = f"MLP {IN} -> {ACT_DEPTH} x {WIDTH} -> {CLASSES}, Adam, batch {ACT_BATCH}, m = {MICRO}, GPipe"
    out.append({"name": "remat_activation_saving_p2_m8", "value": top_r / top_k, "target": 0.5,
                "higher_is_better": False,
                "unit": "x the same run keeping activations (largest stage's max RSS - RSS after imports)",
                "detail": f"{model}: {per}; step {step_k * 1e3:.0f} -> {step_r * 1e3:.0f} ms (remat.py)"})
    out.append({"name": "remat_step_time_cost_p2_m8", "value": step_r / step_k, "target": 1.35,
                "higher_is_better": False, "unit": "x median step time keeping activations (slower stage)",
                "detail": f"{model}: {step_k * 1e3:.0f} -> {step_r * 1e3:.0f} ms per step; noisy on a shared "
                          "2-core machine (remat.py)"})
    return out


def main(argv: list[str]) -> int:
    if "--worker" in argv:
        worker(argv[argv.index("--worker") + 1], argv[argv.index("--out") + 1])
        return 0
    names = list(CONFIGS)
    if "--only" in argv:  # e.g. --only act_gpipe,act_gpipe_remat (results/remat.json then holds those)
        names = argv[argv.index("--only") + 1].split(",")
        unknown = sorted(set(names) - set(CONFIGS))
        if unknown:
            raise SystemExit(f"remat.py: unknown configuration(s) {unknown}; choose from {sorted(CONFIGS)}")
    before = {"loadavg": list(os.getloadavg()), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as d:
        res = {n: launch(n, Path(d)) for n in names}
    result = {"model": f"MLP {IN} -> {DEPTH} x {WIDTH} -> {CLASSES}, Adam, batch {GLOBAL_BATCH}, m = {MICRO}",
              "machine_before": before, "configs": res, "rows": rows(res)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "remat.json").write_text(json.dumps(result, indent=1) + "\n")
    for r in result["rows"]:
        print(f"{r['name']:>40} {r['value']:8.3f}  {r['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
