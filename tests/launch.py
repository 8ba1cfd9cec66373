"""Run a user script through the `tarantella` launcher of this venv, as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900


def tarantella(ranks: int, script: Path, *args: str, cwd: Path | None = None,
               python: str = sys.executable) -> subprocess.CompletedProcess:
    """``tarantella -n ranks -- script args`` with ``python``'s launcher; output captured.

    One compute thread per rank: the ranks share the CI machine's two cores.
    """
    bindir = Path(python).parent
    launcher = shutil.which("tarantella", path=str(bindir))
    if launcher is None:
        raise RuntimeError(f"no `tarantella` launcher in {bindir} (pip install tnt-keras)")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1",
           "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [launcher, "-n", str(ranks), "-x", "OMP_NUM_THREADS=1", "--python-interpreter", python,
           "--", str(script), *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)


def explain(proc: subprocess.CompletedProcess) -> str:
    """The ends of a finished job's output, for assertion messages."""
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
