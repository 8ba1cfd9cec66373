"""Helpers shared by the tnt-cli tests (a uniquely named module, unlike conftest)."""

from __future__ import annotations

import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

VERSION_TEXTS = {
    "openmpi5": "mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n",
    "openmpi4": "mpirun (Open MPI) 4.1.5\n\nReport bugs to http://www.open-mpi.org/community/help/\n",
    "mpich": (
        "HYDRA build details:\n    Version:                                 4.1.2\n"
        "    Release Date:                            Wed Jun  7 15:22:45 CDT 2023\n"
        "    CC:                              gcc\n"
    ),
    "intel": "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)\n"
             "Copyright 2003-2023, Intel Corporation.\n",
}


def write_executable(path: Path, body: str) -> Path:
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll until `predicate()` holds; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def is_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
