"""Measured per-rank peak memory (issue 29): every rank of a real launch, one process per
configuration, so that no phase of another configuration is in the figure.

    python benchmarks/memory.py [--quick]          (run_all.py: memory; launches its own jobs)
    python benchmarks/memory.py --only dp2,pp2     (named configurations only, for development)

The model is the issue's MLP: Dense(2048 -> 4096) + 5 x Dense(4096) + Dense(10), 92 M
parameters, Adam, global batch 64, one epoch of 4 steps. Each configuration runs in
processes of its own (``mpirun -n N python memory.py --worker CONFIG``): serial Keras in one
process, tnt DATA on 2 ranks (built eagerly: every replica holds the whole model), tnt
PIPELINING p = 2 and p = 4 (m = 4) and tnt TENSOR t = 2, built under
``tnt.deferred_variables()``. A rank's peak is ``getrusage(RUSAGE_SELF).ru_maxrss`` at the end
of ``fit`` minus its resident set size (VmRSS) right after ``import tensorflow, tarantella``:
what the model, its training and tnt added. A sampling thread (every 2 ms) also records the
largest RSS seen in each phase (build, wrap, compile, fit, after), to say where a peak
comes from; the rows take getrusage's figure, which sees every page. The serial run keeps
glibc's default allocator settings (``TNT_MALLOC_MMAP_THRESHOLD=0``: as a plain Keras script
runs); tnt's ranks run with tarantella's fixed mmap threshold (docs/memory.md).

Rows (results/memory.json -> summary.json through summary.py), each the largest rank's
peak / serial Keras' peak:

- dp_peak_memory_vs_serial_2ranks (target <= 1.10)
- pipeline_peak_memory_largest_stage_p2 (<= 0.60), pipeline_peak_memory_largest_stage_p4
  (<= 0.35; 4 ranks time-share the cores: bytes, not time, are measured)
- tensor_peak_memory_per_rank_t2 (<= 0.55)
- memory_estimate_error_max: the largest |estimate / measured - 1| over the ranks of every
  configuration, the estimate being ``model.memory_report()``'s total (<= 0.15)
- save_peak_memory_master_p2, save_peak_memory_master_t2 (<= 0.15): the master's peak
  during ``model.save`` of the pp2 (tp2) model after its fit (VmHWM after resetting the
  kernel's peak counter with ``/proc/self/clear_refs`` <- "5", minus VmRSS right before
  the save) / the serial model's state (its parameters + its optimizer's variables after
  fit, counted on the serial Keras run). Every rank saves (the save is collective); the
  row takes rank 0's.
- load_peak_memory_rank_p2, load_peak_memory_rank_t2 (no target: measured): the largest
  rank's peak while every rank loads that file into the same layout
  (``tnt.models.load_model``, beside the trained model it still holds; VmHWM reset before,
  minus VmRSS before) / the serial model's state.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchlib  # light: no TensorFlow, no MPI at import

HERE = Path(__file__).parent
RESULTS = HERE / "results"
WIDTH, IN, DEPTH, CLASSES = 4096, 2048, 5, 10
GLOBAL_BATCH, STEPS = 64, 4

#: name -> (ranks, strategy, options)
CONFIGS: dict[str, tuple[int, str, dict]] = {
    "serial": (1, "serial", {}),
    "dp2": (2, "DATA", {}),
    "pp2": (2, "PIPELINING", {"num_pipeline_stages": 2, "num_micro_batches": 4}),
    "pp4": (4, "PIPELINING", {"num_pipeline_stages": 4, "num_micro_batches": 4}),
    "tp2": (2, "TENSOR", {"tensor_parallel_size": 2}),
}


def rss() -> int:
    """Resident set size now, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Reset the kernel's peak RSS counter (VmHWM) of this process to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def vm_hwm() -> int:
    """Peak resident set size since the last :func:`reset_peak`, bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def max_rss() -> int:
    """Peak resident set size of this process so far, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PhaseSampler:
    """Largest RSS seen per phase, sampled on a thread (attribution only)."""

    def __init__(self, period: float = 0.002) -> None:
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            r = rss()
            if r > self.peaks.get(self.phase, 0):
                self.peaks[self.phase] = r
            time.sleep(period)

    def enter(self, phase: str) -> None:
        r = rss()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), r)
        self.phase = phase
        self.peaks[phase] = max(self.peaks.get(phase, 0), r)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def mlp(keras):
    inputs = keras.Input((IN,))
    x = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    for _ in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def worker(config: str, out: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    import tarantella as tnt

    baseline = rss()
    sampler = PhaseSampler()
    import keras

    ranks, strategy, options = CONFIGS[config]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((GLOBAL_BATCH * STEPS, IN), dtype=np.float32)
    y = rng.integers(0, CLASSES, GLOBAL_BATCH * STEPS)
    keras.utils.set_random_seed(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    sampler.enter("build")
    if strategy in ("serial", "DATA"):
        model = mlp(keras)  # DATA: every replica holds the whole model (eager build)
    else:
        with tnt.deferred_variables():
            model = mlp(keras)
    sampler.enter("wrap")
    if strategy != "serial":
        model = tnt.Model(model, parallel_strategy=getattr(tnt.ParallelStrategy, strategy), **options)
    sampler.enter("compile")
    model.compile(keras.optimizers.Adam(1e-4), loss)
    sampler.enter("fit")
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    fit_s = time.perf_counter() - t0
    sampler.enter("after")
    peak = max_rss()
    after = rss()
    phases = sampler.stop()
    report = None
    if strategy != "serial" and hasattr(model, "memory_report"):
        report = model.memory_report()
    rank = tnt.get_rank() if strategy != "serial" else 0
    state_bytes = None
    if strategy == "serial":  # what a save writes: parameters + optimizer variables
        state_bytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                          for v in [*model.weights, *model.optimizer.variables])
    save = load = None
    if config in ("pp2", "tp2"):  # the peak during save, on top of what the rank holds before
        path = f"{out}.save.keras"
        before = rss()
        reset_peak()
        t0 = time.perf_counter()
        model.save(path)
        save = {"peak_bytes": vm_hwm() - before, "seconds": time.perf_counter() - t0,
                "file_bytes": os.path.getsize(path)}
        # then the peak while every rank loads that file into the same layout (beside the
        # trained model it still holds)
        before = rss()
        reset_peak()
        t0 = time.perf_counter()
        loaded = tnt.models.load_model(path, parallel_strategy=getattr(tnt.ParallelStrategy, strategy), **options)
        load = {"peak_bytes": vm_hwm() - before, "seconds": time.perf_counter() - t0}
        del loaded
    record = {
        "config": config, "rank": rank, "ranks": ranks, "baseline_bytes": baseline,
        "peak_bytes": peak - baseline, "after_fit_bytes": after - baseline,
        "phase_peak_bytes": {k: v - baseline for k, v in phases.items()}, "fit_seconds": fit_s,
        "estimate": report, "state_bytes": state_bytes, "save": save, "load": load,
        "tf": tf.__version__,
    }
    Path(f"{out}.{rank}.json").write_text(json.dumps(record, indent=1, default=float))


def launch(config: str, tmp: Path) -> list[dict]:
    """Run one configuration in fresh processes; its ranks' records, in rank order."""
    ranks = CONFIGS[config][0]
    out = tmp / config
    run = [sys.executable, str(Path(__file__).resolve()), "--worker", config, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    if config == "serial":  # plain Keras' allocator, as a user's serial script gets it
        env["TNT_MALLOC_MMAP_THRESHOLD"] = "0"
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = run if config == "serial" else [benchlib.mpirun(), "--oversubscribe", "--bind-to", "none", "-n", str(ranks), *run]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, timeout=1200)
    records = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(ranks)]
    print(f"{config}: " + ", ".join(f"rank {r['rank']} peak {r['peak_bytes'] / 2**20:.0f} MiB"
                                    f" (after fit {r['after_fit_bytes'] / 2**20:.0f})" for r in records)
          + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
    return records


def largest(records: list[dict]) -> dict:
    return max(records, key=lambda r: r["peak_bytes"])


def rows(res: dict[str, list[dict]]) -> list[dict]:
    serial = res["serial"][0]["peak_bytes"]
    mib = 2**20

    def row(name: str, config: str, target: float, what: str) -> dict | None:
        if config not in res:
            return None
        recs = res[config]
        top = largest(recs)
        phases = ", ".join(f"{k} {v / mib:.0f}" for k, v in top["phase_peak_bytes"].items())
        est = top["estimate"]
        est_s = f"; estimate {est['total_bytes'] / mib:.0f} MiB" if est else ""
        return {"name": name, "value": top["peak_bytes"] / serial, "target": target, "higher_is_better": False,
                "unit": "x serial Keras peak (max RSS - RSS after imports)",
                "detail": f"{what}: per rank " + ", ".join(f"{r['peak_bytes'] / mib:.0f}" for r in recs)
                + " MiB (after fit " + ", ".join(f"{r['after_fit_bytes'] / mib:.0f}" for r in recs)
                + f") vs serial {serial / mib:.0f} MiB; largest rank's sampled phase peaks (MiB): {phases}{est_s}"
                " (memory.py)"}

    out = [
        row("dp_peak_memory_vs_serial_2ranks", "dp2", 1.10, "DATA, 2 ranks"),
        row("pipeline_peak_memory_largest_stage_p2", "pp2", 0.60, "PIPELINING p = 2, m = 4, deferred build"),
        row("pipeline_peak_memory_largest_stage_p4", "pp4", 0.35, "PIPELINING p = 4, m = 4, deferred build, 4 ranks"),
        row("tensor_peak_memory_per_rank_t2", "tp2", 0.55, "TENSOR t = 2, deferred build"),
    ]
    errors = [(abs(r["estimate"]["total_bytes"] / r["peak_bytes"] - 1), c, r["rank"])
              for c, recs in res.items() for r in recs if r.get("estimate")]
    if errors:
        worst = max(errors)
        out.append({"name": "memory_estimate_error_max", "value": worst[0], "target": 0.15,
                    "higher_is_better": False, "unit": "|memory_report() total / measured peak - 1|",
                    "detail": "; ".join(f"{c} rank {k}: {e:.3f}" for e, c, k in errors)
                    + f"; worst {worst[1]} rank {worst[2]} (memory.py)"})
    state = res["serial"][0]["state_bytes"]
    for config, suffix in (("pp2", "p2"), ("tp2", "t2")):
        if config not in res or not res[config][0].get("save"):
            continue
        master = res[config][0]["save"]
        out.append({"name": f"save_peak_memory_master_{suffix}", "value": master["peak_bytes"] / state,
                    "target": 0.15, "higher_is_better": False,
                    "unit": "x serial model state (parameters + optimizer variables)",
                    "detail": f"master's VmHWM during model.save of the {config} model minus VmRSS before: "
                    f"{master['peak_bytes'] / mib:.0f} MiB vs state {state / mib:.0f} MiB; other ranks "
                    + ", ".join(f"{r['save']['peak_bytes'] / mib:.0f}" for r in res[config][1:])
                    + f" MiB; save {master['seconds']:.1f} s, file {master['file_bytes'] / mib:.0f} MiB (memory.py)"})
        loads = [r["load"] for r in res[config]]
        top = max(loads, key=lambda r: r["peak_bytes"])
        out.append({"name": f"load_peak_memory_rank_{suffix}", "value": top["peak_bytes"] / state,
                    "target": None, "higher_is_better": False,
                    "unit": "x serial model state (parameters + optimizer variables), largest rank",
                    "detail": f"each rank's VmHWM during tnt.models.load_model of that file into the {config} "
                    "layout minus VmRSS before (MiB): " + ", ".join(f"{r['peak_bytes'] / mib:.0f}" for r in loads)
                    + f" vs state {state / mib:.0f} MiB; load {top['seconds']:.1f} s (memory.py)"})
    return [r for r in out if r is not None]


def main(argv: list[str]) -> int:
    if "--worker" in argv:
        worker(argv[argv.index("--worker") + 1], argv[argv.index("--out") + 1])
        return 0
    names = list(CONFIGS)
    if "--only" in argv:
        names = ["serial", *[n for n in argv[argv.index("--only") + 1].split(",") if n != "serial"]]
    if "--quick" in argv:
        names = [n for n in names if n != "pp4"]
    before = {"loadavg": list(os.getloadavg()), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as d:
        res = {n: launch(n, Path(d)) for n in names}
    result = {"model": f"MLP {IN}->{WIDTH} + {DEPTH} x {WIDTH} -> {CLASSES}, Adam, batch {GLOBAL_BATCH}, "
                       f"{STEPS} steps", "machine_before": before, "configs": res, "rows": rows(res)}
    if "--only" not in argv:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "memory.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"\n{'row':>40} {'value':>8} {'target':>8}")
    for r in result["rows"]:
        target = "-" if r["target"] is None else f"{r['target']:.3f}"
        print(f"{r['name']:>40} {r['value']:8.3f} {target:>8}  {r['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
