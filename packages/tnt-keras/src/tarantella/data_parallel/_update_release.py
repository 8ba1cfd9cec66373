"""When each owned variable's update may run during a level-2 backprop: after which
reduce-scatter bucket, so that the replicas update equal amounts between two collectives.

Note [Level 2's updates released in step]
Each reduce-scatter is a point where every replica waits for the slowest. A replica that
updates a variable between two of them (one compute thread: between two backward ops)
makes the others wait at the next one; with whole-variable ownership the two replicas'
updates fell into different intervals, so a step paid the sum of every replica's update
time instead of the largest replica's (measured: the 92 M MLP's level-2 step 3.0-3.4 s ->
3.7-4.2 s on 2 ranks, docs/sharding.md "What it costs in time"). So an update is released
only once every replica has had as much owned work arrive as this replica will have done
with it: replica r's k-th update waits for the first bucket by whose end each replica's
owned elements sum to at least r's first k updates. Updates then run side by side on all
replicas; what cannot be matched runs after the last reduce-scatter, as before updates
moved into backprop. A pure function of the buckets, the owners and the sizes, so every
replica computes the same release points without talking; the order of the updates and
their arithmetic are unchanged (bitwise), only when they may start.
"""

from __future__ import annotations

from collections.abc import Sequence


def release_buckets(buckets: Sequence[Sequence[int]], owners: Sequence[int], sizes: Sequence[int],
                    replicas: int) -> dict[int, int]:
    """Variable position -> index of the bucket (in ``buckets``' wire order) whose
    reduce-scatter must end before the owner's update of that variable starts.

    ``sizes`` are per position (elements, the update's work); a position's update order is
    the buckets' order, as :meth:`Sharding._update_order` runs them during backprop."""
    if not buckets:
        return {}
    last = len(buckets) - 1
    arrived = [0] * replicas  # owned elements whose sums arrived, per replica
    common: list[int] = []  # per bucket: the least any replica has had arrive by its end
    for idx in buckets:
        for i in idx:
            arrived[owners[i]] += sizes[i]
        common.append(min(arrived))
    release: dict[int, int] = {}
    for replica in range(replicas):
        done, b = 0, 0
        for k, idx in enumerate(buckets):
            for i in (i for i in idx if owners[i] == replica):
                done += sizes[i]
                b = max(b, k)
                while b < last and common[b] < done:
                    b += 1
                release[i] = b
    return release
