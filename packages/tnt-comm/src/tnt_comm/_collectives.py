"""Plain collectives on numpy arrays (and pickled objects), mirroring mpi4py's names.

Each call first exchanges every rank's (shape, dtype), so a disagreement is a clear
ValueError on every rank instead of a hang or garbage. All waits release the GIL.
"""

from __future__ import annotations

import enum
import pickle
from typing import Any

import numpy as np

from . import _runtime
from ._dtypes import check_array

_core = _runtime._core


class Op(enum.IntEnum):
    """Reduction operator. AVG = SUM / size(), for float dtypes only."""

    SUM = 0
    AVG = 1
    MIN = 2
    MAX = 3


def rank() -> int:
    """This process's rank in the job (0 when run without a launcher)."""
    _runtime.ensure()
    return int(_core.rank())


def size() -> int:
    """Number of processes in the job."""
    _runtime.ensure()
    return int(_core.size())


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
    _runtime.ensure()
    _core.barrier()


def allreduce(array: np.ndarray, op: Op = Op.SUM) -> np.ndarray:
    """A new array, same shape and dtype, holding the element-wise reduction over ranks."""
    a = check_array(array, "allreduce", reducible=True)
    op = Op(op)
    if op is Op.AVG and a.dtype.kind in "iu":
        raise ValueError(
            f"allreduce: Op.AVG is not defined for integer dtype {a.dtype.name} (the mean is "
            "not an integer); use Op.SUM and divide by size(), or convert to a float dtype"
        )
    _runtime.ensure()
    out = np.empty(a.shape, a.dtype)
    _core.allreduce(a, out, int(op))
    return out


def broadcast(array: np.ndarray, root: int = 0) -> np.ndarray:
    """A new array holding the root's data on every rank.

    Every rank passes an array of the root's shape and dtype (non-root contents are
    ignored, e.g. ``np.empty_like``).
    """
    a = check_array(array, "broadcast", reducible=False)
    _runtime.ensure()
    root = int(root)
    out = a.copy() if root == _core.rank() else np.empty_like(a)
    _core.broadcast(out, root)
    return out


def allgather(array: np.ndarray) -> np.ndarray:
    """Concatenation of every rank's array along axis 0, in rank order.

    Lengths along axis 0 may differ (also 0); dtype and trailing dimensions must agree.
    """
    a = check_array(array, "allgather", reducible=False)
    _runtime.ensure()
    return _core.allgather(a)


def _pickled(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def broadcast_object(obj: Any, root: int = 0) -> Any:
    """The root's ``obj`` on every rank (pickled; for small metadata)."""
    is_root = int(root) == rank()
    payload = _pickled(obj) if is_root else np.empty(0, np.uint8)
    n = broadcast(np.array([payload.size], np.int64), root)
    data = broadcast(payload if is_root else np.empty(int(n[0]), np.uint8), root)
    return obj if is_root else pickle.loads(data.tobytes())


def allgather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled; for small metadata)."""
    payload = _pickled(obj)
    lengths = allgather(np.array([payload.size], np.int64))
    data = allgather(payload).tobytes()
    out: list[Any] = []
    start = 0
    for n in lengths.tolist():
        out.append(pickle.loads(data[start : start + n]))
        start += n
    return out
