"""A rank's local model: the serial functional graph with each split layer replaced.

``shard_model`` replays the serial model's graph on new inputs, calling each split
layer's shard (``shard_layer``) in its place and every other layer as it is (the serial
layer object: its variables are the local model's). A nested functional model (a
keras-hub backbone inside a task model) whose layers the plan splits is replayed too,
as a nested model of the same name and structure (its variables keep their serial
places); one the plan keeps whole is called as it is.
"""

from __future__ import annotations

import keras

from .._core import internals as _internals
from .._core.errors import TensorParallelError
from .._core.graph import ModelGraph, model_graph
from ._blocks import block_shard
from ._collectives import TensorGroup
from ._layers import (
    ColumnDense,
    RowDense,
    SliceDropout,
    VocabEmbedding,
    VocabReversibleEmbedding,
    heads_attention,
)
from ._plan import (
    BLOCK,
    COLUMN,
    COLUMN_GATHER,
    FFN,
    HEADS,
    REPLICATED,
    ROW,
    SPLIT_AXES,
    VOCAB,
    _nested,
    flatten,
    passes_inputs,
    var_name,
)


def shard_layer(layer, kind: str, group: TensorGroup):
    """The shard layer this rank builds in place of ``layer`` split as ``kind``."""
    if kind == COLUMN:
        return ColumnDense(layer, group, gather=False)
    if kind == COLUMN_GATHER:
        return ColumnDense(layer, group, gather=True)
    if kind == ROW:
        return RowDense(layer, group)
    if kind == VOCAB:
        if type(layer) is keras.layers.Embedding:
            return VocabEmbedding(layer, group)
        return VocabReversibleEmbedding(layer, group)
    if kind == HEADS:
        return heads_attention(layer, group)
    if kind == BLOCK:
        return block_shard(layer, group)
    if kind == FFN:
        return block_shard(layer, group, attention=False)
    raise TensorParallelError(f"layer {layer.name!r}: unknown split {kind!r}")


def _splits_inside(model, plan) -> bool:
    names = {s.name for s in plan.layers if s.kind != REPLICATED} | set(plan.split_dropouts)
    return any(layer.name in names or (_nested(layer) and _splits_inside(layer, plan)) for layer in model.layers)


def _replay(graph: ModelGraph, values: dict, plan, group: TensorGroup, shards: dict) -> None:
    for call in graph.calls:
        layer = call.layer
        args, kwargs = call.node.arguments.fill_in(values)
        if _nested(layer) and _splits_inside(layer, plan):
            if not passes_inputs(layer, args, kwargs):
                raise TensorParallelError(
                    f"the nested model {layer.name!r} is called with other arguments than its inputs; its "
                    "layers cannot be split. plan.replicate(...) its layers, or call it on its inputs only.")
            layer = _sharded(layer, plan, group, shards, name=layer.name)
            kwargs = {}
        elif layer.name in plan.split_dropouts:
            layer = SliceDropout(layer, group)
        elif plan.kind(layer.name) != REPLICATED:
            if layer.name not in shards:
                shards[layer.name] = shard_layer(layer, plan.kind(layer.name), group)
            layer = shards[layer.name]
        for name, new in zip(call.outputs, keras.tree.flatten(layer(*args, **kwargs))):
            values[id(graph.keras_tensors[name])] = new


def _sharded(model: keras.Model, plan, group: TensorGroup, shards: dict, name: str) -> keras.Model:
    graph = model_graph(model)
    values: dict[int, object] = {}
    inputs = []
    for j, tensor in enumerate(graph.inputs):
        kt = graph.keras_tensors[tensor]
        new = keras.Input(shape=kt.shape[1:], dtype=kt.dtype, name=graph.input_layer_names[j])
        values[id(kt)] = new
        inputs.append(new)
    _replay(graph, values, plan, group, shards)
    outputs = keras.tree.map_structure(lambda n: values[id(graph.keras_tensors[n])], graph.output_struct)
    functional = model._functional if isinstance(model, keras.Sequential) else model
    structure = _internals.functional_structure(functional)[0]
    return keras.Model(inputs=keras.tree.pack_sequence_as(structure, inputs), outputs=outputs, name=name)


def shard_model(model: keras.Model, plan, group: TensorGroup, shards: dict) -> keras.Model:
    """``model``'s functional graph with each layer ``plan`` splits replaced by its shard
    layer on this rank of ``group`` (made once per layer, kept in ``shards`` by name) and
    every other layer reused as it is; a nested model with split layers becomes a nested
    model of the same name and input structure whose layers are replaced the same way, so
    every variable keeps its serial place (``<layer>/<index>`` of the top-level layers)."""
    return _sharded(model, plan, group, shards, name=f"{model.name}_tp{group.rank}")


def split_variables(model: keras.Model, shards: dict, plan):
    """(variable of ``model``, shard layer's variable, split axis or None) for every weight
    of the layers of ``model`` (nested ones included) that ``shards`` replaces."""
    layers = {layer.name: layer for layer in flatten(model).layers}
    for name, shard in shards.items():
        axes = SPLIT_AXES[plan.kind(name)]
        local = {var_name(w, shard): w for w in shard.weights}
        whole = layers[name]
        for w in whole.weights:
            key = var_name(w, whole)
            if key not in local:
                raise TensorParallelError(f"the shard of {name!r} has no variable {key!r} (it has {sorted(local)}).")
            yield w, local[key], axes.get(key)


__all__ = ["shard_layer", "shard_model", "split_variables"]
