"""tnt_comm: Tarantella's MPI communication core.

Communicators (the world, and groups split from it) with collectives and checked
point-to-point messages on numpy arrays (mpi4py-like names), and a fused, overlapped
allreduce engine. One background thread per process owns every MPI call; all waits release the
GIL. See docs/comm.md.
"""

from __future__ import annotations

from ._collectives import (
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    local_rank,
    local_size,
    long_local_work,
    rank,
    reduce_scatter,
    size,
)
from ._comm import Communicator, Op, Request, world
from ._errors import CommError, StallError
from ._fused import FusedAllreduce, TensorSpec, plan_buckets
from ._native import C_API_VERSION, c_api_address, c_api_include_dir
from ._runtime import abort, finalize, init, is_initialized

__version__ = "0.1.0"

__all__ = [
    "C_API_VERSION",
    "CommError",
    "Communicator",
    "FusedAllreduce",
    "Op",
    "Request",
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
    "c_api_address",
    "c_api_include_dir",
    "finalize",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "long_local_work",
    "plan_buckets",
    "rank",
    "reduce_scatter",
    "size",
    "world",
]
