"""Serial Keras references of a real-model job, shared out over the ranks.

Each case of a real-model job compares a tnt run against serial Keras trained in the
same job. Trained by the master alone, the other ranks wait case after case (about half
the part's time on 2 ranks); here each rank trains a share of the references before any
tnt run (the longest first to the least loaded rank), and the master gathers them. What
is compared does not change: a reference is the same plain Keras fit from the same seeds
on whichever rank trains it (each case also records the difference between the
reference's initial weights and those its tnt run starts from, which must be 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import keras

import tarantella as tnt
import tnt_comm


def assign(names: Sequence[str], size: int, costs: Mapping[str, float] | None = None) -> list[list[str]]:
    """The names each rank trains: longest first to the least loaded rank (by ``costs``,
    e.g. seconds measured; 1 each when not given), the same on every rank."""
    load, out = [0.0] * size, [[] for _ in range(size)]
    for name in sorted(names, key=lambda n: -(costs or {}).get(n, 1.0)):
        r = load.index(min(load))
        out[r].append(name)
        load[r] += (costs or {}).get(name, 1.0)
    return out


def shared(names: Sequence[str], train: Callable[[str], dict],
           costs: Mapping[str, float] | None = None) -> dict[str, dict]:
    """``train(name)`` for every name, spread over the ranks (``assign``); the master gets
    them all (``{name: reference}``, in ``names`` order, each with its ``"seconds"``), the
    other ranks ``{}``.

    The Keras session is cleared afterwards, so that every rank's auto-generated layer
    names start equal again for the tnt runs (ranks trained different references)."""
    rank, size = tnt.get_rank(), tnt.get_size()
    with tnt_comm.long_local_work():  # the other ranks may wait here for a long reference
        mine = {name: _timed(train, name) for name in assign(names, size, costs)[rank]}
    gathered = tnt_comm.allgather_object(mine)
    keras.backend.clear_session()
    if not tnt.is_master_rank():
        return {}
    merged = {name: ref for part in gathered for name, ref in part.items()}
    return {name: merged[name] for name in names}


def _timed(train: Callable[[str], dict], name: str) -> dict:
    t0 = time.perf_counter()
    ref = train(name)
    return {**ref, "seconds": time.perf_counter() - t0}
