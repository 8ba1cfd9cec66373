"""This rank's timeline events, recorded while a timeline is open (``tarantella.timeline``).

Every instrumented place asks :func:`recorder` once per pass and records nothing when it
is ``None`` (no timeline open): the cost when off is one module-global read. Times are
``time.perf_counter()`` seconds (cheap, monotonic); the recorder keeps the offset to
``time.time()`` taken when it started, which the merge on the master corrects per rank
with a measured clock offset.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

#: Lanes (Chrome-trace threads) of a rank, in display order.
LANES = ("step", "compute", "comm", "sync", "data")


class Recorder:
    """The events of one rank: (name, category, lane, start, end, args), perf_counter seconds."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, float, float, dict]] = []
        self.wall_minus_perf = time.time() - time.perf_counter()
        self.meta: dict = {}

    def add(self, name: str, cat: str, lane: str, start: float, end: float, **args) -> None:
        """One complete event from ``start`` to ``end`` (``time.perf_counter()`` seconds)."""
        self.events.append((name, cat, lane, start, end, args))

    @contextmanager
    def span(self, name: str, cat: str, lane: str, **args):
        """Record the time spent in the ``with`` block as one event."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.events.append((name, cat, lane, t0, time.perf_counter(), args))


_recorder: Recorder | None = None


def recorder() -> Recorder | None:
    """The open recorder, or None when no timeline is being recorded."""
    return _recorder


def start() -> Recorder:
    """Open a new recorder (replacing any open one) and return it."""
    global _recorder
    _recorder = Recorder()
    return _recorder


def resume(rec: Recorder | None) -> None:
    """Make ``rec`` the open recorder again (after a nested timeline closed)."""
    global _recorder
    _recorder = rec


def stop() -> Recorder | None:
    """Close the open recorder and return it (None if none was open)."""
    global _recorder
    rec, _recorder = _recorder, None
    return rec
