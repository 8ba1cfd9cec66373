"""Pipeline stages balanced by measured time for ``ParallelStrategy.PIPELINING`` (and
``ALL``): ``tnt.Model(model, pipeline_plan=tnt.auto.time_balanced_plan(model, 2, rows))``.

The pipeline's own default balances bytes: it is chosen when ``tnt.Model`` is built, before
any batch is seen, and the same on every rank without measuring. A time balance needs the
micro-batch size (a layer's time grows with its rows, its bytes do not) and a measurement,
which differs from rank to rank: rank 0 times the layers (``profile``) and every rank takes
its cut points, so every rank builds the same stages.
"""

from __future__ import annotations

import keras

from .._core import runtime as _runtime
from ._partition import time_split_after
from ._profile import Profile, profile


class StagePlanError(ValueError):
    """The model cannot be cut into the stages asked for."""


def _cuts(model: keras.Model, num_stages: int, rows: int, profile_: Profile | None,
          micro_batches: int | None) -> list[str] | Exception:
    """Rank 0's cut points, or the error every rank raises (none waits on a failed rank 0)."""
    try:
        prof = profile_ if profile_ is not None else profile(model, [rows])
    except Exception as e:
        return e
    cuts = time_split_after(prof, num_stages, rows, micro_batches)
    if cuts is None:
        return StagePlanError(f"tnt.auto.time_balanced_plan: {model.name!r} has {len(prof.layers)} layer(s), "
                              f"fewer than num_stages={num_stages}; use fewer stages.")
    return cuts


def time_balanced_plan(model: keras.Model, num_stages: int, micro_batch_size: int, *,
                       micro_batches: int | None = None, profile_: Profile | None = None):
    """The pipeline plan of ``model`` whose ``num_stages`` contiguous stages minimise the
    slowest stage's measured forward + backward time at ``micro_batch_size`` samples (the
    global batch / replicas / micro-batches). ``micro_batches``: the micro-batches per step;
    given, a stage's time is that many passes plus its variables' per-step cost (their
    update), so the stage holding most weights is not overloaded. In a launched job every
    rank calls it (rank 0 measures, the others take its cuts). ``profile_``: a profile to use
    instead of timing."""
    from .. import pipelining

    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}.")
    if micro_batches is not None and (not isinstance(micro_batches, int) or isinstance(micro_batches, bool)
                                      or micro_batches < 1):
        raise ValueError(f"micro_batches must be a positive integer (the micro-batches per step) or None, "
                         f"got {micro_batches!r}.")
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive integer (samples per micro-batch on a rank), "
                         f"got {micro_batch_size!r}.")
    if not model.built:
        raise ValueError(f"tnt.auto.time_balanced_plan: model {model.name!r} is not built; build it first.")
    if num_stages == 1:
        return pipelining.plan(model, 1)
    if _runtime.get_size() == 1:
        cuts = _cuts(model, num_stages, micro_batch_size, profile_, micro_batches)
    else:
        import tnt_comm

        mine = _cuts(model, num_stages, micro_batch_size, profile_, micro_batches) if _runtime.get_rank() == 0 else None
        cuts = tnt_comm.broadcast_object(mine, root=0)
    if isinstance(cuts, Exception):
        raise cuts
    try:
        return pipelining.plan(model, split_after=cuts)
    except Exception as e:  # the cut falls where the pipeline cannot cut (e.g. inside a residual block)
        raise StagePlanError(f"tnt.auto.time_balanced_plan: the time-balanced cut after {cuts} is not one the "
                             f"pipeline can make ({str(e).splitlines()[0]}); give the stages yourself with "
                             "tnt.pipelining.plan(model, split_after=[...]) or keep the bytes-balanced default."
                             ) from e
