"""``tnt.plan_parallel``: enumerate every layout of ``num_ranks`` ranks, predict each from
one measured profile, drop those over the memory budget, take the fastest.

The space is small and searched exhaustively: d x p x t over the divisors of N, sharding
levels 0-2 of the data replicas (d > 1: DATA's, and ALL's replicas of stages or of tensor
groups) and level 3 for DATA, micro-batches m in {p, 2p, 4p} dividing the replica's batch.
Stages come from the pipeline's own automatic plan (contiguous, balanced by parameter
bytes) and tensor splits from the tensor plan, so the prediction is of the layout
``tnt.Model`` will really build.
"""

from __future__ import annotations

from dataclasses import replace

import keras

from .._core import memory as _memory
from .._core.memory import MemoryBudgetError
from . import _cache, _comm
from ._budget import default_budget, ranks_on_host
from ._cost import Level3, Split, Stages, estimate
from ._layout import Layout
from ._partition import time_split_after
from ._plan import Candidate, Plan, _mib
from ._profile import Profile, profile

DEFAULT_OPTIMIZER_SLOTS = 2  # Adam's, when the model is not compiled yet


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(num_ranks: int, global_batch: int) -> tuple[list[Layout], list[Candidate]]:
    """Every layout of ``num_ranks`` ranks; those the batch cannot feed, rejected."""
    out: list[Layout] = []
    bad: list[Candidate] = []
    for d in _divisors(num_ranks):
        for p in _divisors(num_ranks // d):
            t = num_ranks // (d * p)
            if global_batch % d:
                bad.append(Candidate(Layout(d, p, t), None,
                                     f"global batch {global_batch} does not divide by {d} replicas"))
                continue
            levels = (0, 1, 2) if d > 1 else (0,)
            if p == 1:
                # level 3 (parameters sharded too) is DATA's only (ALL refuses it)
                out.extend(Layout(d, 1, t, sharding=s) for s in (*levels, *((3,) if t == 1 and d > 1 else ())))
                continue
            ms = [m for m in (p, 2 * p, 4 * p) if (global_batch // d) % m == 0]
            if not ms:
                bad.append(Candidate(Layout(d, p, t, micro_batches=p), None,
                                     f"the replica's batch {global_batch // d} does not divide into "
                                     f"{p}, {2 * p} or {4 * p} micro-batches"))
            # each with and without recomputation of the stages' activations (remat="stages")
            out.extend(Layout(d, p, t, micro_batches=m, remat=r, sharding=s)
                       for m in ms for r in (False, True) for s in levels)
    return out, bad


def _slots(model) -> int:
    opt = getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None
    trainable = list(model.trainable_variables)
    tb = _memory.variable_bytes(trainable)
    if opt is None or not tb:
        return DEFAULT_OPTIMIZER_SLOTS
    return round(_memory.slot_bytes(opt, trainable) / tb)


def _why_not_sharded(model) -> str | None:
    """Why the model's optimizer cannot be sharded (None: it can; an uncompiled model gets
    Adam's defaults, which can)."""
    from ..data_parallel import ShardingError, check_optimizer

    opt = getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None
    if opt is None:
        return None
    try:
        check_optimizer(opt, 1)
    except ShardingError as e:
        return f"no sharding: {str(e)[:160]}"
    return None


def _level3(model, d: int) -> Level3 | str:
    """Level 3's holdings of ``model`` on d replicas (counted as its memory report counts
    them), or why level 3 cannot run it."""
    from ..data_parallel import ShardingError, level3_layout

    try:
        lay = level3_layout(model, d)
    except ShardingError as e:
        return f"no sharding=3: {str(e)[:160]}"
    return Level3(tuple((h.parameters, h.gradients, h.owned_trainable, h.gathered) for h in lay.replicas),
                  dict(lay.layer_bytes), lay.whole_trainable_bytes)


def _too_few_to_own(model, d: int, stage: Stages | None) -> str | None:
    """Why d replicas cannot each own whole variables at sharding 1-2 (each replica group
    needs at least d trainable variables: DATA's whole model, or each pipeline stage's), or
    None. tnt.Model refuses such a layout at build; the planner rejects it first."""
    groups = [list(model.trainable_variables)] if stage is None else [
        [v for name in names for v in model.get_layer(name).trainable_variables] for names in stage.layer_names]
    for i, variables in enumerate(groups):
        if len(variables) < d:
            where = "the model has" if stage is None else f"stage {i} has"
            return (f"no sharding: {where} {len(variables)} trainable variable(s) for {d} replicas to own "
                    "whole ones")
    return None


def _split(model, t: int, prof: Profile) -> Split | str:
    """The tensor plan as fractions, or why t ranks cannot split the model."""
    from .. import tensor_parallel

    try:
        tp = tensor_parallel.plan(model, tensor_parallel_size=t)
    except Exception as e:  # any refusal is a rejection with its message
        return f"no tensor plan: {str(e).splitlines()[0][:120]}"
    split = {s.name: s for s in tp.layers if s.split_params}
    if not split:
        return f"nothing splits over t={t} (every layer replicated)"
    frac = {n: (s.params - s.split_params * (t - 1) / t) / s.params for n, s in split.items() if s.params}
    fwd, bwd = tp.collectives_per_step()
    acts = prof.by_name()
    mean_out = sum(acts[n].activation_bytes_per_sample for n in split if n in acts) / max(len(split), 1)
    return Split(frac, int((fwd + bwd) * mean_out), max(1, fwd + bwd))


def _stages(model, p: int, split_after: list[str] | None = None, open_size: int | None = None) -> Stages | str:
    """The pipeline plan's stages (its own, or cut after ``split_after``), or why ``model``
    cannot be cut into p; ``open_size``: the length of the boundaries' open dimensions."""
    from .. import pipelining

    try:
        pp = pipelining.plan(model, p) if split_after is None else pipelining.plan(model, split_after=split_after)
    except Exception as e:  # any refusal is a rejection with its message
        return f"no pipeline plan: {str(e).splitlines()[0][:120]}"
    if pp.num_stages != p:
        return f"the model's markers make {pp.num_stages} stages, not {p}"
    receive = []
    for i, st in enumerate(pp.stages):
        bds = [pp.boundaries[b] for b in (*st.inputs, *(() if i == p - 1 else st.outputs))]
        receive.append(sum(_prod(b.shape, open_size) * _itemsize(b.dtype) for b in bds))
    after = pp.split_after
    return Stages(tuple(tuple(st.layer_names) for st in pp.stages), tuple(receive),
                  tuple(after) if after is not None else None)


def _pairs_apart(model, t: int, p: int, stage: Stages) -> str | None:
    """Why a t-rank tensor plan cannot run on these p stages (a column-split layer and its
    row-split partner on two stages: ALL refuses to build that), or None."""
    from .. import hybrid, pipelining, tensor_parallel

    try:
        pp = pipelining.plan(model, p) if stage.split_after is None else \
            pipelining.plan(model, split_after=list(stage.split_after))
        hybrid.check_pairs_in_one_stage(tensor_parallel.plan(model, tensor_parallel_size=t), pp)
    except Exception as e:  # any refusal is a rejection with its message
        return f"tensor pair split by the stage cut: {str(e).splitlines()[0][:160]}"
    return None


def _prod(shape, open_size: int | None = None) -> int:
    n = 1
    for d in tuple(shape):  # a boundary's shape is per sample; an open dimension at open_size
        n *= int(d or open_size or 1)
    return n


def _itemsize(dtype) -> int:
    import numpy as np

    return np.dtype(str(dtype)).itemsize


class _StagePlans:
    """Per p, the pipeline's own (bytes-balanced) stages and, where they differ and the
    pipeline accepts the cuts, the stages balanced by measured time at the layout's rows."""

    def __init__(self, model, prof: Profile) -> None:
        self.model, self.prof = model, prof
        self.by_bytes: dict[int, Stages | str] = {}
        self.by_time: dict[tuple, Stages | str] = {}

    def options(self, p: int, rows: int, micro_batches: int) -> list[tuple[str, Stages | str]]:
        if p not in self.by_bytes:
            self.by_bytes[p] = _stages(self.model, p, open_size=self.prof.sequence_length)
        out: list[tuple[str, Stages | str]] = [("bytes", self.by_bytes[p])]
        cuts = time_split_after(self.prof, p, rows, micro_batches)
        if cuts is None:
            return out
        key = tuple(cuts)
        if key not in self.by_time:
            self.by_time[key] = _stages(self.model, p, cuts, self.prof.sequence_length)
        timed = self.by_time[key]
        bytes_plan = self.by_bytes[p]
        if isinstance(timed, Stages) and not (isinstance(bytes_plan, Stages)
                                              and bytes_plan.split_after == timed.split_after):
            out.append(("time", timed))
        return out


def rows_considered(candidates: list[Layout], global_batch: int) -> list[int]:
    """Micro-batch sizes (samples per rank per forward) the layouts run at."""
    return sorted({global_batch // (c.replicas * c.micro_batches) for c in candidates})


def _profiled(model, rows: list[int], profile_file: str | None, sequence_length: int | None,
              ranks_on_host: int) -> Profile:
    if profile_file is None:
        return profile(model, rows, sequence_length, ranks_on_host)
    wanted = _cache.key(model, rows, sequence_length, ranks_on_host)
    prof = _cache.load(profile_file, wanted)
    if prof is None:
        prof = profile(model, rows, sequence_length, ranks_on_host)
        _cache.store(profile_file, wanted, prof)
    return prof


def plan_parallel(model: keras.Model, num_ranks: int, global_batch_size: int, memory_budget=None, *,
                  network: _comm.Network | None = None, optimizer_slots: int | None = None,
                  profile_: Profile | None = None, profile_file: str | None = None,
                  sequence_length: int | None = None) -> Plan:
    """Choose how to run ``model`` on ``num_ranks`` ranks at ``global_batch_size`` within
    ``memory_budget`` bytes per rank (default: this machine's share, see ``_budget``).

    Runs on one process (nothing is launched): it times the model's layers here, predicts
    every layout and returns a :class:`Plan` (``plan.summary()`` says why). Raises
    ``tnt.MemoryBudgetError`` naming the smallest feasible budget when no layout fits.
    ``profile_file``: keep the profile there and reuse it while the model's config, the
    micro-batch sizes and the machine are the same. ``sequence_length``: the length of every
    dimension the model leaves open beyond the batch (``None`` in its inputs' shapes: a
    keras-hub Transformer's sequence), at which its layers are timed and their activations
    counted.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"tnt.plan_parallel takes a Keras model, got {type(model).__name__}.")
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive integer, got {num_ranks!r}.")
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r} "
                         "(the batch size the dataset is batched with).")
    if sequence_length is not None and (not isinstance(sequence_length, int) or isinstance(sequence_length, bool)
                                        or sequence_length < 1):
        raise ValueError(f"tnt.plan_parallel(sequence_length=...) takes a positive integer (the length the "
                         f"model trains at), got {sequence_length!r}.")
    if not model.built:
        raise ValueError(f"tnt.plan_parallel: model {model.name!r} is not built; build it (call it on an "
                         "input, or give it an Input) before planning.")
    if profile_ is not None and sequence_length is not None and profile_.sequence_length != sequence_length:
        raise ValueError(f"tnt.plan_parallel: the given profile was measured at sequence_length="
                         f"{profile_.sequence_length!r}, not {sequence_length!r}; leave sequence_length= out to plan "
                         "at the profile's length, or drop the profile to measure one at the new length.")
    budget = _memory.parse_bytes(memory_budget)
    source = "memory_budget="
    if budget is None:
        budget, source = default_budget(num_ranks)
    net = network or _comm.Network()
    slots = optimizer_slots if optimizer_slots is not None else _slots(model)
    layouts_, rejected = layouts(num_ranks, global_batch_size)
    # the ranks sharing this host's cores, as the default budget takes them (_budget)
    prof = profile_ or _profiled(model, rows_considered(layouts_, global_batch_size), profile_file, sequence_length,
                                 min(ranks_on_host(num_ranks), num_ranks))
    splits: dict[int, Split | str] = {}
    feasible: list[Candidate] = []
    stage_plans = _StagePlans(model, prof)
    apart: dict[tuple, str | None] = {}  # (t, p, cut) -> why the tensor pairs do not fit the stages
    unshardable = _why_not_sharded(model)
    level3: dict[int, Level3 | str] = {}  # d -> level 3's holdings, or why not
    for base in layouts_:
        if base.sharding and unshardable is not None:
            rejected.append(Candidate(base, None, unshardable))
            continue
        if base.tensor > 1 and base.tensor not in splits:
            splits[base.tensor] = _split(model, base.tensor, prof)
        split = splits.get(base.tensor) if base.tensor > 1 else None
        if base.sharding == 3 and base.replicas not in level3:
            level3[base.replicas] = _level3(model, base.replicas)
        sharded3 = level3.get(base.replicas) if base.sharding == 3 else None
        rows = global_batch_size // (base.replicas * base.micro_batches)
        options = stage_plans.options(base.stages, rows, base.micro_batches) if base.stages > 1 else [("", None)]
        for partition, stage in options:
            lay = base
            why = next((x for x in (split, stage, sharded3) if isinstance(x, str)), None)
            if why is None and base.sharding in (1, 2):
                why = _too_few_to_own(model, base.replicas, stage)
            if why is not None:
                rejected.append(Candidate(lay, None, why))
                continue
            if stage is not None and base.tensor > 1:
                key = (base.tensor, base.stages, stage.split_after)
                if key not in apart:
                    apart[key] = _pairs_apart(model, base.tensor, base.stages, stage)
                if apart[key] is not None:
                    rejected.append(Candidate(lay, None, apart[key]))
                    continue
            if stage is not None and stage.split_after is not None:
                lay = replace(lay, split_after=stage.split_after, partition=partition)
            est = estimate(prof, lay, global_batch_size, slots, net, split, stage, sharded3)
            if budget is not None and est.total_bytes > budget:
                rejected.append(Candidate(lay, est, f"over budget by {_mib(est.total_bytes - budget)}"))
            else:
                feasible.append(Candidate(lay, est))
    if not feasible:
        sized = [c for c in rejected if c.estimate is not None]
        if not sized:
            raise ValueError(f"tnt.plan_parallel: no layout of {num_ranks} rank(s) applies: "
                             + "; ".join(f"{c.layout.describe()}: {c.rejected}" for c in rejected))
        smallest = min(sized, key=lambda c: c.estimate.total_bytes)
        raise MemoryBudgetError(
            f"tnt.plan_parallel: no layout of {num_ranks} rank(s) fits memory_budget={_mib(budget)} per rank "
            f"({source}). The smallest feasible budget is {_mib(smallest.estimate.total_bytes)} "
            f"({smallest.estimate.total_bytes} bytes, "
            f"{smallest.layout.describe()}); raise memory_budget= to at least that, use more ranks, "
            "or a smaller global batch.")
    feasible.sort(key=lambda c: (c.estimate.step_s, c.layout.num_ranks, c.layout.stages, c.layout.tensor,
                                 c.layout.sharding))
    rejected.sort(key=lambda c: (c.estimate is None, c.estimate.step_s if c.estimate else 0.0))
    notes = [*prof.notes, f"optimizer slots per trainable weight: {slots}",
             f"communication: alpha = {net.alpha_s * 1e6:.0f} us, beta = {net.beta_Bps / 1e9:.2f} GB/s, "
             f"a collective inside a step {net.collective_s * 1e6:.0f} us ({net.name})",
             f"profile measured here at {', '.join(map(str, prof.rows_measured))} rows per forward "
             f"(linear in between), each layer net of a call's fixed cost ({prof.call_s * 1e3:.2f} ms); "
             f"a step's own cost {prof.step_overhead_s() * 1e3:.2f} ms; a pipeline stage's own cost "
             "{:.2f} ms per step + {:.2f} ms per micro-batch".format(*(1e3 * s for s in prof.pipeline_overheads()))
             + f" + {prof.pipeline_variable_s * 1e3:.2f} ms per variable"]
    return Plan(num_ranks, global_batch_size, budget, source, feasible[0], feasible, rejected, notes, net)
