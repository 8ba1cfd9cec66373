"""The split rule, framework-free: which samples of a global batch each rank gets.

Global batch k of size B_k is cut into ``size`` contiguous slices in rank order; rank r
gets ``B_k // size + (1 if r < B_k % size else 0)`` samples, so the first ``B_k % size``
ranks take one extra. Everything else in tnt_data derives from these functions.
"""

from __future__ import annotations

import numpy as np

from tnt_data.errors import DistributionError


def check_rank_size(rank: int, size: int) -> None:
    """Raise DistributionError unless 0 <= rank < size."""
    for name, value in (("rank", rank), ("size", size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise DistributionError(
                f"{name} must be an int, got {type(value).__name__} {value!r}."
            )
    if size < 1:
        raise DistributionError(f"size must be >= 1 (the number of ranks), got {size}.")
    if not 0 <= rank < size:
        raise DistributionError(f"rank must be in [0, size) = [0, {size}), got {rank}.")


def _check_batch(global_batch_size: int) -> None:
    if isinstance(global_batch_size, bool) or not isinstance(
        global_batch_size, (int, np.integer)
    ):
        raise DistributionError(
            f"global_batch_size must be an int, got {global_batch_size!r}."
        )
    if global_batch_size < 0:
        raise DistributionError(f"global_batch_size must be >= 0, got {global_batch_size}.")


def micro_batch_size(global_batch_size: int, rank: int, size: int) -> int:
    """Samples rank ``rank`` gets from a global batch of ``global_batch_size``."""
    check_rank_size(rank, size)
    _check_batch(global_batch_size)
    return global_batch_size // size + (1 if rank < global_batch_size % size else 0)


def micro_batch_sizes(global_batch_size: int, size: int) -> list[int]:
    """Micro-batch sizes of all ranks, in rank order; they sum to the global batch size."""
    check_rank_size(0, size)
    return [micro_batch_size(global_batch_size, r, size) for r in range(size)]


def micro_batch_slice(global_batch_size: int, rank: int, size: int) -> slice:
    """Positions of rank ``rank``'s samples inside a global batch (a contiguous slice)."""
    check_rank_size(rank, size)
    _check_batch(global_batch_size)
    base, extra = divmod(global_batch_size, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def global_batch_sizes(length: int, global_batch_size: int, drop_remainder: bool = False) -> list[int]:
    """Sizes of the serial batches of a sequence of ``length`` samples."""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
        raise DistributionError(f"length must be an int >= 0, got {length!r}.")
    _check_batch(global_batch_size)
    if global_batch_size == 0:
        raise DistributionError("global_batch_size must be >= 1 to batch a sequence.")
    full, rest = divmod(length, global_batch_size)
    return [global_batch_size] * full + ([rest] if rest and not drop_remainder else [])


def index_plan(
    length: int,
    global_batch_size: int,
    rank: int,
    size: int,
    drop_remainder: bool = False,
) -> list[np.ndarray]:
    """Sample indices rank ``rank`` processes at each step, for a sequence of ``length``.

    Step k covers serial batch k (indices ``k*B .. k*B+B_k-1``); the returned list has one
    int64 array per step (possibly empty), the same number of steps on every rank. Apply a
    permutation first (``perm[plan[k]]``) to get a shuffled plan; use it from NumPy or
    PyTorch code (e.g. as a batch sampler) without TensorFlow.
    """
    check_rank_size(rank, size)
    plan = []
    for k, batch in enumerate(global_batch_sizes(length, global_batch_size, drop_remainder)):
        part = micro_batch_slice(batch, rank, size)
        start = k * global_batch_size
        plan.append(np.arange(start + part.start, start + part.stop, dtype=np.int64))
    return plan


def steps(length: int, global_batch_size: int, drop_remainder: bool = False) -> int:
    """Number of steps (serial batches) for a sequence of ``length`` samples."""
    return len(global_batch_sizes(length, global_batch_size, drop_remainder))
