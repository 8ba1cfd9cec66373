"""tnt_comm: Tarantella's MPI communication core.

Collectives on numpy arrays (mpi4py-like names) and a fused, overlapped allreduce
engine. One background thread per process owns every MPI call; all waits release the
GIL. See docs/comm.md.
"""

from __future__ import annotations

from ._collectives import (
    Op,
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    local_rank,
    local_size,
    rank,
    size,
)
from ._errors import CommError, StallError
from ._fused import FusedAllreduce, TensorSpec, plan_buckets
from ._runtime import abort, finalize, init, is_initialized

__version__ = "0.1.0"

__all__ = [
    "CommError",
    "FusedAllreduce",
    "Op",
    "StallError",
    "TensorSpec",
    "__version__",
    "abort",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "finalize",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "plan_buckets",
    "rank",
    "size",
]
