"""What tarantella's fixed glibc mmap threshold costs in step time (issue 29).

    python benchmarks/malloc_threshold.py [--rounds K]   (run_all.py: malloc_threshold)

Tarantella fixes glibc's M_MMAP_THRESHOLD at 4 MiB when imported (docs/memory.md, "The
allocator"), so that large tensors are mapped and returned to the system when freed. The
price is a system call and fresh, zeroed pages for every large allocation. This measures it:
tnt DATA on 2 ranks, the memory benchmark's MLP (92 M parameters, Adam, global batch 64),
10 steps; the median step time of steps 2-10 with the fixed threshold and with glibc's
default (``TNT_MALLOC_MMAP_THRESHOLD=0``), the two launched alternately K times (default 2)
so that a change of the machine's load hits both alike; the ratio of the medians over the
rounds.

Row (results/malloc_threshold.json -> summary.json):

- dp_step_time_fixed_mmap_threshold_vs_glibc_default_2ranks: fixed / default (target
  <= 1.03: the memory it saves must not cost more than 3 % of step time)
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
from memory import CLASSES, GLOBAL_BATCH, max_rss, mlp, rss

HERE = Path(__file__).parent
RESULTS = HERE / "results"
STEPS = 10
SETTINGS = {"fixed_4MiB": None, "glibc_default": "0"}


def worker(out: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np

    import tarantella as tnt

    baseline = rss()
    import keras

    rng = np.random.default_rng(0)
    x = rng.standard_normal((GLOBAL_BATCH * STEPS, 2048), dtype=np.float32)
    y = rng.integers(0, CLASSES, GLOBAL_BATCH * STEPS)
    keras.utils.set_random_seed(0)
    model = tnt.Model(mlp(keras), parallel_strategy=tnt.ParallelStrategy.DATA)
    model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    times: list[float] = []
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[benchlib.step_times(keras, times)])
    record = {"rank": tnt.get_rank(), "step_seconds": times, "median_step_seconds": statistics.median(times[1:]),
              "peak_bytes": max_rss() - baseline}
    Path(f"{out}.{record['rank']}.json").write_text(json.dumps(record))


def launch(setting: str, tmp: Path, k: int) -> dict:
    out = tmp / f"{setting}{k}"
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TNT_MALLOC_MMAP_THRESHOLD", None)
    if SETTINGS[setting] is not None:
        env["TNT_MALLOC_MMAP_THRESHOLD"] = SETTINGS[setting]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    run = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out)]
    subprocess.run([benchlib.mpirun(), "--oversubscribe", "--bind-to", "none", "-n", "2", *run],
                   env=env, check=True, timeout=1800)
    recs = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    median = max(r["median_step_seconds"] for r in recs)
    peak = max(r["peak_bytes"] for r in recs)
    print(f"{setting} round {k}: median step {median * 1e3:.0f} ms, peak {peak / 2**20:.0f} MiB "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return {"median_step_seconds": median, "peak_bytes": peak, "ranks": recs}


def main(argv: list[str]) -> int:
    if "--worker" in argv:
        worker(argv[argv.index("--out") + 1])
        return 0
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2
    before = {"loadavg": list(os.getloadavg()), "cores": os.cpu_count()}
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as d:
        for k in range(rounds):
            for s in SETTINGS:
                runs[s].append(launch(s, Path(d), k))
    med = {s: statistics.median(r["median_step_seconds"] for r in runs[s]) for s in SETTINGS}
    peak = {s: max(r["peak_bytes"] for r in runs[s]) for s in SETTINGS}
    ratio = med["fixed_4MiB"] / med["glibc_default"]
    row = {"name": "dp_step_time_fixed_mmap_threshold_vs_glibc_default_2ranks", "value": ratio, "target": 1.03,
           "higher_is_better": False, "unit": "x median step time with glibc's default threshold",
           "detail": f"DATA 2 ranks, 92 M-parameter MLP, Adam, batch {GLOBAL_BATCH}: median step "
                     f"{med['fixed_4MiB'] * 1e3:.0f} ms fixed 4 MiB vs {med['glibc_default'] * 1e3:.0f} ms default "
                     f"over {rounds} alternating rounds; peak {peak['fixed_4MiB'] / 2**20:.0f} vs "
                     f"{peak['glibc_default'] / 2**20:.0f} MiB (malloc_threshold.py)"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "malloc_threshold.json").write_text(json.dumps(
        {"machine_before": before, "runs": runs, "rows": [row]}, indent=1) + "\n")
    print(f"{row['name']} {ratio:.3f}  {row['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
