"""Predicted per-rank memory (by category, as ``tnt.Model.memory_report()`` counts it)
and step time of one layout, from a measured :class:`~._profile.Profile`.

Memory follows ``_core.memory.estimate`` (docs/memory.md) for what each layout holds:
weights, gradients, optimizer slots (``/ d`` with sharding 1 or 2; at level 3 each replica's
own weights, gradient sums and slots as ``tnt.data_parallel.level3_layout`` counts them, plus
a layer's gathered copies), the pipeline's gradient accumulator, activations of the
micro-batches in flight (1F1B: ``min(p - s, m)`` on stage s; one set with ``remat``, whose
inputs are still held per micro-batch), the engine's gradient buffer when gradients are
reduced over replicas and received boundary tensors. Time: the profile's forward + backward
of the layers a rank runs (tensor-split layers at ``1/t``) at its rows plus a Keras step's
own cost (``_step_overhead``); a pipeline's ``m + p - 1`` slots of its slowest stage with the
executor's own cost per micro-batch, per step and per variable (``_pipeline_overhead``);
the optimizer's update; and the collectives from the alpha-beta model (``_comm``).
Recomputation (``remat``) runs each stage's forward twice: the profile times forward +
backward together, so the second forward is taken as ``REMAT_FORWARD_SHARE`` of it
(backward about twice the forward; benchmarks/remat.py measured 1.39x the 1F1B step on an MLP).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._core import settings as _settings
from .._core.memory import UPDATE_TEMPORARIES
from .._core.shard_buckets import BUCKET_BYTES
from . import _comm
from ._layout import Layout
from ._profile import Profile

#: Sharding's reduce-scatter + allgather against their ring cost (= one ring allreduce of
#: the same bytes): tnt_comm's pairwise reduce-scatter and MPI's allgather measured 1.34-1.46x
#: the allreduce on 2 ranks and 1.05-1.23x on 3 (docs/sharding.md, "The collectives
#: themselves"; 3.7-4.4x with libnbc's reduce-scatter before); charged so.
SHARDED_COLLECTIVES_FACTOR = 1.4
#: The forward pass's share of forward + backward, the extra cost of remat="stages".
REMAT_FORWARD_SHARE = 1 / 3


@dataclass
class Estimate:
    """One layout's prediction: bytes per category on its fullest rank, and the step."""

    memory: dict[str, int]
    step_s: float
    compute_s: float
    comm_s: float

    @property
    def total_bytes(self) -> int:
        """Bytes of every category together."""
        return sum(self.memory.values())


@dataclass(frozen=True)
class Split:
    """Per layer name, the fraction of its weights (and time) one tensor-group rank keeps,
    the activation bytes per sample of the collectives a step makes, and how many they are."""

    local_fraction: dict[str, float]
    collective_bytes_per_sample: int
    collectives: int = 1


@dataclass(frozen=True)
class Stages:
    """The pipeline plan's stages as layer names, and boundary bytes per sample."""

    layer_names: tuple[tuple[str, ...], ...]
    receive_bytes_per_sample: tuple[int, ...]
    split_after: tuple[str, ...] | None


@dataclass(frozen=True)
class Level3:
    """Sharding level 3 of DATA's d replicas, as ``tnt.data_parallel.level3_layout`` counts
    it: per replica (parameters, gradients, owned trainable bytes, gathered copies), the
    bytes each per-layer gathered layer moves, and the trainable bytes kept whole."""

    replicas: tuple[tuple[int, int, int, int], ...]
    layer_bytes: dict[str, int]
    whole_trainable_bytes: int


def _level3_memory(prof: Profile, level3: Level3, slots: int, rows: int) -> dict[str, int]:
    """The fullest replica's bytes at level 3: its stored weights and gradient sums, the slots
    of what it owns, a layer's gathered copies and DATA's activations."""
    acts = sum(c.activation_bytes_per_sample for c in prof.layers) * rows
    worst: dict[str, int] = {}
    for params, grads, owned, gathered in level3.replicas:
        mem = {"parameters": params, "gradients": grads, "optimizer_slots": slots * owned,
               "gradient_accumulators": 0, "activations": acts, "communication_buffers": gathered,
               "receive_buffers": 0, "update_temporaries": _update_temporaries(prof.layers)}
        if not worst or sum(mem.values()) > sum(worst.values()):
            worst = mem
    return worst


def _level3_sync_s(level3: Level3, d: int, net: _comm.Network) -> float:
    """Per gathered layer two allgathers (forward, backward) and a reduce-scatter of its
    bytes, one collective each (their latency counts per layer); what stays whole takes
    level 2's reduce-scatter and allgather. All charged ``SHARDED_COLLECTIVES_FACTOR`` as level 2's,
    and each its own cost in the step (Note [A collective inside a step], ``_comm``)."""
    per_layer = sum(3 * _comm.allgather_s(d, b, net) for b in level3.layer_bytes.values())
    whole = 2 * _comm.allgather_s(d, level3.whole_trainable_bytes, net)
    count = 3 * len(level3.layer_bytes) + 2 * _buckets(level3.whole_trainable_bytes)
    return SHARDED_COLLECTIVES_FACTOR * (per_layer + whole) + count * net.collective_s


def _buckets(nbytes: int) -> int:
    """Sharding's collectives over ``nbytes``: one per bucket (``_core.shard_buckets``)."""
    return -(-int(nbytes) // BUCKET_BYTES) if nbytes > 0 else 0


def _memory(prof: Profile, names, split: Split | None, slots: int, layout: Layout, rows: int,
            in_flight: int, receive_per_sample: int, staged: bool = True) -> dict[str, int]:
    """Bytes per category of one rank (as ``_core.memory.estimate`` counts its holdings);
    ``staged``: the replicas' gradient exchange keeps a gradient set of buckets (False for
    DATA's transient buckets, waited one at a time: they replace the gradients they carry)."""
    activation_sets = min(1, in_flight) if layout.remat else in_flight
    keep = None if names is None else set(names)
    frac = split.local_fraction if split is not None else {}
    layers = [c for c in prof.layers if keep is None or c.name in keep]
    params = int(sum(c.weight_bytes * frac.get(c.name, 1.0) for c in layers))
    grads = int(sum(c.trainable_bytes * frac.get(c.name, 1.0) for c in layers))
    acts = int(sum(c.activation_bytes_per_sample * frac.get(c.name, 1.0) for c in layers))
    d = layout.replicas
    slot_bytes = slots * grads // (d if layout.sharding else 1)
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer_slots": slot_bytes,
        "gradient_accumulators": 0,  # pipeline stages sum micro-batches in place, into the gradients
        "activations": acts * rows * activation_sets,
        "communication_buffers": grads if d > 1 and staged else 0,
        "receive_buffers": receive_per_sample * rows * in_flight,
        "update_temporaries": _update_temporaries(layers, frac),
    }


def _share(layout: Layout) -> float:
    """The share of its variables' updates a rank runs: 1/d where the replicas shard them."""
    return 1 / layout.replicas if layout.sharding else 1.0


def _update_temporaries(layers, frac: dict[str, float] | None = None) -> int:
    """As ``_core.memory.update_temporary_bytes``, with the largest layer's trainable bytes
    (times its local fraction under a tensor split) standing for its largest variable: the
    profile keeps bytes per layer (an upper bound for layers of several large variables)."""
    frac = frac or {}
    largest = max((int(c.trainable_bytes * frac.get(c.name, 1.0)) for c in layers), default=0)
    return UPDATE_TEMPORARIES * largest


def _replica_sync_s(layout: Layout, grad_bytes: int, param_bytes: int, net: _comm.Network) -> float:
    """The replicas' exchange: DATA's fused allreduce (the engine's, outside the step's ops),
    or sharding's bucketed gathers and reduce-scatters, graph ops that each also pay their own
    cost in the step (Note [A collective inside a step], ``_comm``)."""
    d = layout.replicas
    if d > 1 and layout.sharding in (1, 2):
        in_step = (_buckets(param_bytes) + (_buckets(grad_bytes) if layout.sharding == 2 else 0)) * net.collective_s
    else:
        in_step = 0.0
    if layout.sharding == 1:
        return (_comm.allreduce_s(d, grad_bytes, net) + SHARDED_COLLECTIVES_FACTOR * _comm.allgather_s(d, param_bytes, net)
                + in_step)
    if layout.sharding == 2:
        return (SHARDED_COLLECTIVES_FACTOR * (_comm.allgather_s(d, grad_bytes, net) + _comm.allgather_s(d, param_bytes, net))
                + in_step)
    return _comm.allreduce_s(d, grad_bytes, net)


def estimate(prof: Profile, layout: Layout, global_batch: int, slots: int, net: _comm.Network,
             split: Split | None = None, stages: Stages | None = None, level3: Level3 | None = None) -> Estimate:
    """Memory and step time of ``layout`` (``split``: its tensor plan when t > 1;
    ``stages``: its pipeline plan when p > 1; ``level3``: its holdings at sharding=3)."""
    d, p, t, m = layout.replicas, layout.stages, layout.tensor, layout.micro_batches
    # each split layer's local fraction of its weights: of its time, and of its update
    scale = {n: f for n, f in (split.local_fraction.items() if split is not None else ())}
    tensor_comm = 0.0
    if layout.sharding == 3:
        assert level3 is not None and p == 1 and t == 1
        rows = -(-global_batch // d)
        # backprop recomputes each gathered layer's forward (its activations are not kept)
        compute = prof.contention * (  # Note [Ranks that share a host's cores] (_profile)
            prof.time_s(rows) + REMAT_FORWARD_SHARE * prof.time_s(rows, names=level3.layer_bytes)
            + prof.update_s(share=1 / d) + prof.step_overhead_s())  # Note [The update's time]: owners update
        sync = _level3_sync_s(level3, d, net)
        return Estimate(_level3_memory(prof, level3, slots, rows), compute + sync, compute, sync)
    if p == 1:
        rows = -(-global_batch // d)
        # As the layouts' memory reports: DATA's fused engine frees each bucket with its last
        # holder (TNT_COMM_TRANSIENT_BUCKETS, default on); tensor groups' replicas stage a set.
        mem = _memory(prof, None, split, slots, layout, rows, 1, 0,
                      staged=split is not None or not _settings.transient_buckets())
        # Note [The update's time] (_profile): each replica updates all it holds, or its owned 1/d
        compute = prof.contention * (  # Note [Ranks that share a host's cores] (_profile)
            prof.time_s(rows, scale=scale) + prof.update_s(fraction=scale, share=_share(layout))
            + prof.step_overhead_s())  # fit's own step (_step_overhead, Note [A step's own cost])
        if split is not None:
            tensor_comm = _comm.in_step_allreduces_s(t, split.collectives, split.collective_bytes_per_sample * rows, net)
        sync = _replica_sync_s(layout, mem["gradients"], mem["parameters"], net)
        return Estimate(mem, compute + tensor_comm + sync, compute, tensor_comm + sync)
    assert stages is not None
    rows = -(-global_batch // (d * m))
    worst: dict[str, int] | None = None
    slowest = 0.0
    update = 0.0  # the stages update side by side after the schedule: the slowest one counts
    sync = 0.0
    for s, names in enumerate(stages.layer_names):
        # no accumulator set: a stage sums its micro-batches' gradients in place, into the
        # gradient set itself (pipelining, Note [Gradients summed in place])
        mem = _memory(prof, names, split, slots, layout, rows, min(p - s, m),
                      stages.receive_bytes_per_sample[s])
        if worst is None or sum(mem.values()) > sum(worst.values()):
            worst = mem
        stage_time = prof.time_s(rows, names, scale=scale) * (1 + REMAT_FORWARD_SHARE if layout.remat else 1)
        slowest = max(slowest, stage_time)
        update = max(update, prof.pipeline_update_s(names, scale, _share(layout)))
        sync = max(sync, _replica_sync_s(layout, mem["gradients"], mem["parameters"], net))
    boundary = max(stages.receive_bytes_per_sample) * rows
    p2p = 2 * _comm.p2p_s(boundary, net)  # a forward send and a backward send per slot
    if split is not None:
        tensor_comm = (m + p - 1) * _comm.in_step_allreduces_s(
            t, split.collectives, split.collective_bytes_per_sample * rows, net) / p
    # the executor's own work per step and per micro-batch (_pipeline_overhead, Note [The
    # pipeline's own cost]) beside the slowest stage's layers in each of the m + p - 1 slots
    per_step, per_micro_batch = prof.pipeline_overheads()
    compute = per_step + (m + p - 1) * (slowest + per_micro_batch) + update
    comm = (m + p - 1) * p2p + tensor_comm + sync
    return Estimate(worst or {}, compute + comm, compute, comm)
