"""What a replica holds at sharding level 3, counted from the model's shapes alone (no
values needed, so a model built under ``tnt.deferred_variables()`` is counted unbuilt).

Both ``memory_report()`` of a ``tnt.Model(..., sharding=3)`` and the planner
(``tnt.plan_parallel``, which runs on one process before any replica exists) count it here,
so the two agree by construction. Per replica r (docs/sharding.md, "Level 3"):

- parameters: the per-layer variables r owns, every variable kept whole (Embedding,
  regularized, shared, ...) and every non-trainable variable;
- gradients: the owned per-layer sums plus the whole variables' local gradients (level 2's
  treatment: every replica computes them before the reduce-scatter);
- owned trainable bytes: what r's optimizer builds slots for (ownership is level 1's);
- gathered: ``GATHERED_COPIES`` copies of the largest per-layer gather, the transient of a
  layer's backward (its weights gathered again, the local weight gradient, the
  reduce-scatter's copy of it, and the next layer's weights prefetched meanwhile; the
  forward holds at most two gathered layers, freed before backprop).
"""

from __future__ import annotations

from dataclasses import dataclass

import keras

from ._layer_shards import per_layer_plan
from ._sharding import ShardingError, _nbytes, assign_owners

#: Copies of the largest per-layer gather alive at once in its backward (see module doc).
GATHERED_COPIES = 4


@dataclass(frozen=True)
class Level3Holdings:
    """Bytes one replica holds at level 3 (module doc): the categories of ``memory_report()``
    that differ from level 0, and the owned trainable bytes its optimizer's slots follow."""

    parameters: int
    gradients: int
    owned_trainable: int
    gathered: int


@dataclass(frozen=True)
class Level3Layout:
    """Level 3 of ``model`` over ``size`` replicas: each replica's holdings, and the bytes
    each planned layer gathers (one allgather before its forward, one before its backward,
    one reduce-scatter of its weight gradients per step)."""

    replicas: list[Level3Holdings]
    layer_bytes: dict[str, int]  # planned layer's name -> bytes of its gathered weights
    whole_trainable_bytes: int  # trainable bytes kept whole (level 2's exchange)


def level3_layout(model: keras.Model, size: int) -> Level3Layout:
    """Count level 3's holdings of ``model`` on ``size`` replicas (a pure function of the
    variables' shapes; raises ``ShardingError`` where level 3 cannot run the model)."""
    trainable = list(model.trainable_variables)
    if len(trainable) < size:
        raise ShardingError(
            f"tnt.Model(sharding=3) gives each of the {size} replicas whole variables to own, but "
            f"the model has only {len(trainable)} trainable variables; use sharding=0 or fewer ranks.")
    sizes = [_nbytes(v) for v in trainable]
    owners = assign_owners(sizes, size)
    planned = per_layer_plan(model)
    per_layer = {i for _, positions in planned for i in positions}
    layer_bytes = {layer.name: sum(sizes[i] for i in positions) for layer, positions in planned}
    whole = sum(n for i, n in enumerate(sizes) if i not in per_layer)
    trainable_ids = {id(v) for v in trainable}
    frozen = sum(_nbytes(v) for v in model.variables if id(v) not in trainable_ids)
    gathered = GATHERED_COPIES * max(layer_bytes.values(), default=0)
    replicas = []
    for r in range(size):
        owned_layers = sum(sizes[i] for i in per_layer if owners[i] == r)
        replicas.append(Level3Holdings(
            parameters=whole + frozen + owned_layers, gradients=whole + owned_layers,
            owned_trainable=sum(n for n, o in zip(sizes, owners) if o == r), gathered=gathered))
    return Level3Layout(replicas, layer_bytes, whole)
