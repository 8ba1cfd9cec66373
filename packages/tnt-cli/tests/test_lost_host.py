"""A starter that misreports or hangs after a failure (what Open MPI does when it loses a
host): fake starters replay its output, the launcher must still end non-zero, in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_helpers import VERSION_TEXTS, write_executable

from tnt_cli import supervise

pytestmark = pytest.mark.usefixtures("clean_env")

RULE = "-" * 74


def _starter(tmp_path: Path, body: str) -> Path:
    """An 'mpirun' that answers --version like Open MPI 5 and otherwise runs `body`."""
    (tmp_path / "version.txt").write_text(VERSION_TEXTS["openmpi5"])
    return write_executable(tmp_path / "mpirun", textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then cat {tmp_path / 'version.txt'}; exit 0; fi
        """) + textwrap.dedent(body))


def _launch(tmp_path: Path, starter: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    prog = tmp_path / "train.py"
    prog.write_text("")
    env = {**os.environ, "TNT_MPIRUN": str(starter)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tnt_cli", "-n", "2", "--", str(prog)],
                          capture_output=True, text=True, timeout=60, env=env, check=False)
    return done, time.monotonic() - start


def test_lost_daemon_with_exit_code_0_is_a_failure(tmp_path: Path) -> None:
    starter = _starter(tmp_path, f"""\
        printf '%s\\n' '{RULE}' 'A daemon failed to report back after being spawned.' '{RULE}'
        printf '\\0'
        exit 0
        """)
    done, _ = _launch(tmp_path, starter)
    assert done.returncode == 1, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("tarantella: error: the job failed (exit code 1); cause: the MPI "
                           "daemon of another host ended or could not be reached"), done.stderr
    # No rank explained the failure, so Open MPI's own message is shown (once, no NUL).
    assert done.stderr.count("A daemon failed to report back") == 1 and "\0" not in done.stdout


def test_starter_hanging_after_abort_is_stopped(tmp_path: Path) -> None:
    """It printed MPI_ABORT and then waits for an unreachable host, ignoring SIGTERM."""
    starter = _starter(tmp_path, f"""\
        trap '' TERM
        printf '%s\\n' '{RULE}' 'MPI_ABORT was invoked on rank 2 in communicator MPI_COMM_WORLD' '{RULE}' >&2
        sleep 60
        """)
    done, seconds = _launch(tmp_path, starter)
    assert done.returncode == 128 + 9, done.stderr
    assert seconds < supervise.FAILURE_GRACE_S + supervise.FAILURE_KILL_S + 5, seconds
    assert "the MPI starter had not ended 3 s after the failure (MPI_ABORT was invoked on " \
           "rank 2), so it was stopped" in done.stderr
    assert "MPI_ABORT" not in done.stderr.split("so it was stopped")[1].splitlines()[0]
