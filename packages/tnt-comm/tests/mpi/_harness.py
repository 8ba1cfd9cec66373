"""Shared by the job scripts: a watchdog and a registry of named checks.

A job runs every registered check on every rank and prints `CHECKS OK <count>` on
success; a failing check raises, and tnt_comm's excepthook aborts the whole job.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

CHECKS: list[tuple[str, Callable[[], None]]] = []


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append((fn.__name__, fn))
    return fn


def watchdog(seconds: int = 150) -> None:
    """A hung job dies (SIGALRM) instead of hanging the test suite."""
    signal.alarm(seconds)


def run_all(rank: int) -> None:
    t0 = time.perf_counter()
    for name, fn in CHECKS:
        start = time.perf_counter()
        try:
            fn()
            if rank == 0:
                print(f"rank 0: check {name} took {time.perf_counter() - start:.2f}s", flush=True)
        except BaseException:
            print(f"rank {rank}: check {name} FAILED", file=sys.stderr, flush=True)
            raise
    print(f"rank {rank}: CHECKS OK {len(CHECKS)} in {time.perf_counter() - t0:.2f}s", flush=True)
