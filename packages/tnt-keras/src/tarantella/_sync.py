"""Make every replica start from the master rank's state.

Ranks are compared first (names, shapes and dtypes of every variable), so that a model
built differently on some rank is reported by name instead of corrupting a broadcast or
hanging in it; then the master's values are broadcast, one buffer per dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import tnt_comm

from ._runtime import MASTER_RANK


class ReplicaMismatchError(RuntimeError):
    """The model (or optimizer) differs between ranks."""


def _signature(variables: Sequence) -> list[tuple[tuple[int, ...], str]]:
    # Names are not compared: Keras numbers auto-named layers per process, so the same
    # model may be `dense_4` on one rank and `dense_2` on another. Order, shape and
    # dtype must agree; names only make the error readable.
    return [(tuple(int(d) for d in v.shape), str(v.dtype)) for v in variables]


def verify_same_on_all_ranks(variables: Sequence, what: str) -> None:
    """Raise :class:`ReplicaMismatchError` naming the first variable that differs."""
    mine = (_signature(variables), [v.path for v in variables])
    everyone = tnt_comm.allgather_object(mine)
    reference, ref_names = everyone[MASTER_RANK]
    for rank, (theirs, names) in enumerate(everyone):
        if theirs == reference:
            continue
        if len(theirs) != len(reference):
            detail = f"rank {rank} has {len(theirs)} variables, rank 0 has {len(reference)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(theirs, reference)) if a != b)
            detail = (
                f"variable #{i} is {names[i]} {theirs[i][0]} {theirs[i][1]} on rank {rank} "
                f"but {ref_names[i]} {reference[i][0]} {reference[i][1]} on rank 0"
            )
        raise ReplicaMismatchError(
            f"The {what} differs between ranks: {detail}. Every rank must build the same "
            "model (same layers, in the same order, same input shapes); make sure the model "
            "construction does not depend on the rank or on unseeded randomness."
        )


def broadcast_from_master(variables: Sequence) -> None:
    """Overwrite ``variables`` on every rank with the master rank's values."""
    by_dtype: dict[str, list] = {}
    for var in variables:
        by_dtype.setdefault(str(var.dtype), []).append(var)
    for group in by_dtype.values():
        arrays = [np.asarray(v.numpy()).reshape(-1) for v in group]
        flat = np.concatenate(arrays) if arrays else np.zeros(0)
        flat = tnt_comm.broadcast(np.ascontiguousarray(flat), MASTER_RANK)
        offset = 0
        for var, arr in zip(group, arrays):
            var.assign(flat[offset : offset + arr.size].reshape(var.shape))
            offset += arr.size
