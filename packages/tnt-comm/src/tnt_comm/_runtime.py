"""Process setup: lazy init, finalize at exit, and abort on an uncaught exception."""

from __future__ import annotations

import atexit
import sys
import threading
import time
import types
from typing import NoReturn

from ._loader import load_core

_core = load_core()
_lock = threading.Lock()
_ready = False
_previous_hook = None
_ABORT_DRAIN_S = 0.5  # see abort()


def init() -> None:
    """Start the communication thread (and MPI, unless e.g. mpi4py already did).

    Idempotent and thread-safe; every other function calls it lazily. If MPI was
    initialised first by someone else it must provide MPI_THREAD_MULTIPLE.
    """
    global _ready
    if _ready:
        return
    with _lock:
        if _ready:
            return
        _core.init()
        atexit.register(finalize)
        if _core.size() > 1:
            _install_excepthook()
        _ready = True


def ensure() -> None:
    if not _ready:
        init()


def finalize() -> None:
    """Run what is queued, stop the thread and finalise MPI (if we initialised it).

    Idempotent; registered with atexit by init(). MPI cannot be restarted afterwards.
    """
    _core.finalize()


def is_initialized() -> bool:
    """Whether the communication runtime (MPI and its background thread) is running."""
    return bool(_core.is_initialized())


def abort(code: int = 1) -> NoReturn:
    """End the whole job now (MPI_Abort) with exit status ``code``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # Why: our output goes through a pipe to the MPI starter's forwarder, which reads it
    # asynchronously; MPI_Abort kills this process and its pipe at once, and under load the
    # forwarder had not yet read the end of the traceback — the error message itself (seen
    # in CI: a StallError cut off mid-traceback). A short pause lets it drain.
    time.sleep(_ABORT_DRAIN_S)
    _core.abort(int(code))
    raise AssertionError("unreachable")  # pragma: no cover


def _install_excepthook() -> None:
    # Why: an uncaught exception on one rank would otherwise leave the others waiting in
    # their next collective until the timeout. Chains whatever hook was installed before.
    global _previous_hook
    _previous_hook = sys.excepthook

    def hook(
        exc_type: type[BaseException],
        exc: BaseException,
        tb: types.TracebackType | None,
    ) -> None:
        assert _previous_hook is not None
        _previous_hook(exc_type, exc, tb)
        try:
            rank = _core.rank()
        except Exception:
            rank = -1
        sys.stderr.write(
            f"tnt_comm: uncaught {exc_type.__name__} on rank {rank}; aborting all ranks "
            "(MPI_Abort) so none is left waiting\n"
        )
        abort(1)

    sys.excepthook = hook
