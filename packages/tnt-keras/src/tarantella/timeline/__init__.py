"""``tnt.timeline``: one Chrome-trace / Perfetto JSON of where every rank's time goes.

    with tnt.timeline("trace.json"):      # or TNT_TIMELINE=trace.json for the whole job
        model.fit(...)

    python -m tarantella.timeline summary trace.json

Every rank records its events (``tarantella._core.trace``: pipeline steps, F/B/W passes
per micro-batch and stage, sends and receives with their peer, gradient-sync buckets from
submit to done, waits); on leaving the block (a collective: every rank leaves it) the
master gathers them, corrects each rank's clock by an offset measured with a ping
exchange, and writes one file (``_merge``). ``summary`` (``_summary``) prints per rank
compute, exposed communication, overlap and idle (the bubble). See docs/timeline.md.

The module is callable (``tnt.timeline(path)``) so that the name users write opens a
timeline while ``python -m tarantella.timeline`` still finds the package.
"""

from __future__ import annotations

import atexit
import sys
import types
from contextlib import contextmanager

from .._core import settings as _settings
from .._core import trace as _trace
from ._merge import load, merge_and_write
from ._summary import format_summary, summarize

__all__ = ["format_summary", "load", "merge_and_write", "start", "stop", "summarize", "timeline"]


def start() -> None:
    """Start recording this rank's events (every rank should)."""
    _trace.start()


def stop(path: str) -> dict | None:
    """Stop recording and write the merged timeline of all ranks to ``path`` (a
    collective: every rank calls it). The master returns the trace, the others None."""
    rec = _trace.stop() or _trace.Recorder()
    return merge_and_write(rec, path)


@contextmanager
def timeline(path: str):
    """Record every rank's events inside the block; the master writes ``path`` at its end."""
    if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
        raise TypeError(f"tnt.timeline(path): path must be a file path, got {path!r}")
    outer = _trace.stop()  # TNT_TIMELINE's recorder: it gets this block's events too
    start()
    try:
        yield
    finally:
        rec = _trace.stop() or _trace.Recorder()
        if outer is not None:
            outer.events.extend(rec.events)
        _trace.resume(outer)
        merge_and_write(rec, str(path))


def _start_from_env() -> None:
    """``TNT_TIMELINE=path``: record from import on and write the file at exit."""
    path = _settings.timeline_path()
    if path is None:
        return
    start()
    atexit.register(stop, path)  # after tnt_comm's finalize was registered: runs before it


class _CallableModule(types.ModuleType):
    def __call__(self, path):
        return timeline(path)


sys.modules[__name__].__class__ = _CallableModule
