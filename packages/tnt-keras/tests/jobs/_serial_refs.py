"""Serial Keras references of a real-model job, trained by every rank in turn.

Each case of a real-model job compares a tnt run against serial Keras trained in the same
job. Trained by the master alone, the other ranks wait case after case (about half the
part's time on 2 ranks); here rank r trains the references of cases r, r + size, ...
before any tnt run, and the master gathers them. What is compared does not change: a
reference is the same plain Keras fit from the same seeds on whichever rank trains it
(each case also records the difference between the reference's initial weights and those
its tnt run starts from, which must be 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras

import tarantella as tnt
import tnt_comm


def shared(names: Sequence[str], train: Callable[[str], dict]) -> dict[str, dict]:
    """``train(name)`` for every name, spread over the ranks; the master gets them all
    (``{name: reference}``, in ``names`` order), the other ranks ``{}``.

    The Keras session is cleared afterwards, so that every rank's auto-generated layer
    names start equal again for the tnt runs (ranks trained different references)."""
    rank, size = tnt.get_rank(), tnt.get_size()
    with tnt_comm.long_local_work():  # the other ranks may wait here for a long reference
        mine = {name: train(name) for name in list(names)[rank::size]}
    gathered = tnt_comm.allgather_object(mine)
    keras.backend.clear_session()
    if not tnt.is_master_rank():
        return {}
    merged = {name: ref for part in gathered for name, ref in part.items()}
    return {name: merged[name] for name in names}
