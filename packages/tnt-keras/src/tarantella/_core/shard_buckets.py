"""Buckets of the sharded collectives (``sharding=1|2``): the variables of one dtype cut into
consecutive runs of at most a fixed number of bytes.

Why: the allgather of updated values and the level-2 reduce-scatter used to move a whole
dtype's variables in one flat buffer — a transient copy of every parameter (or gradient)
beside the variables themselves, which made level 1's measured peak exceed plain data
parallelism's (issue 29/30). One bucket at a time, a replica holds at most one bucket's
copy (two while one is being written out). The cut is a pure function of the variables'
sizes and the limit, so every replica makes the same buckets; each bucket keeps the wire
layout of the whole (ordered by owner, then position), so results are bitwise the same.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Bytes per bucket of the sharded collectives unless told: as the fusion threshold's default.
BUCKET_BYTES = 8 << 20


def cut_into_buckets(positions: Sequence[int], nbytes: Sequence[int], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """``positions`` (in their order) cut into consecutive buckets of at most ``limit`` bytes
    (``nbytes[k]`` is the size of ``positions[k]``); an item larger than ``limit`` is a bucket
    of its own. ``limit`` <= 0: one item per bucket."""
    if len(positions) != len(nbytes):
        raise ValueError(f"cut_into_buckets: {len(positions)} positions but {len(nbytes)} sizes")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, n in zip(positions, nbytes):
        if current and filled + int(n) > limit:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += int(n)
    if current:
        buckets.append(current)
    return buckets
