"""The process's place in the job, and the collectives on the world communicator as
module-level functions (``tnt_comm.allreduce(...)`` is ``tnt_comm.world().allreduce(...)``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from . import _runtime
from ._comm import Op, world

_core = _runtime._core


def rank() -> int:
    """This process's rank in the job (0 when run without a launcher)."""
    return world().rank


def size() -> int:
    """Number of processes in the job."""
    return world().size


def local_rank() -> int:
    """Rank among the processes on this host (MPI_COMM_TYPE_SHARED)."""
    _runtime.ensure()
    return int(_core.local_rank())


def local_size() -> int:
    """Number of processes on this host."""
    _runtime.ensure()
    return int(_core.local_size())


def barrier() -> None:
    """Wait until every rank has called barrier()."""
    world().barrier()


def allreduce(array: np.ndarray, op: Op = Op.SUM) -> np.ndarray:
    """A new array, same shape and dtype, holding the element-wise reduction over ranks."""
    return world().allreduce(array, op)


def broadcast(array: np.ndarray, root: int = 0) -> np.ndarray:
    """A new array holding the root's data on every rank (see Communicator.broadcast)."""
    return world().broadcast(array, root)


def allgather(array: np.ndarray) -> np.ndarray:
    """Concatenation of every rank's array along axis 0, in rank order."""
    return world().allgather(array)


def reduce_scatter(array: np.ndarray, counts: Sequence[int] | None = None, op: Op = Op.SUM) -> np.ndarray:
    """This rank's block of the reduction over ranks, split along axis 0 (see
    Communicator.reduce_scatter)."""
    return world().reduce_scatter(array, counts, op)


def broadcast_object(obj: Any, root: int = 0) -> Any:
    """The root's ``obj`` on every rank (pickled; for small metadata)."""
    return world().broadcast_object(obj, root)


def allgather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled; for small metadata)."""
    return world().allgather_object(obj)


@contextlib.contextmanager
def long_local_work() -> Iterator[None]:
    """Marks a long stretch of work on this rank alone (e.g. the master writing a
    checkpoint while the others wait in a barrier).

    While inside, ranks waiting for this one do not raise StallError after
    TNT_COMM_TIMEOUT: their stall check asks this rank, hears "busy on purpose" and
    keeps waiting. Nestable; any thread may use it.
    """
    _runtime.ensure()
    _core.begin_local_work()
    try:
        yield
    finally:
        _core.end_local_work()
