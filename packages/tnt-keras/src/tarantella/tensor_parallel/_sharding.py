"""A rank's local model: the serial functional graph with each split layer replaced.

``shard_model`` replays the serial model's graph on new inputs, calling each split
layer's shard (``shard_layer``) in its place and every other layer as it is (the serial
layer object: its variables are the local model's). A nested functional model (a
keras-hub backbone inside a task model) whose layers the plan splits is replayed inline,
its calls in the outer graph's place, so the local model is flat; one the plan keeps
whole is called as it is.
"""

from __future__ import annotations

import keras

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
    HEADS,
    REPLICATED,
    ROW,
    SPLIT_AXES,
    VOCAB,
    _nested,
    flatten,
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
    raise TensorParallelError(f"layer {layer.name!r}: unknown split {kind!r}")


def _splits_inside(model, plan) -> bool:
    names = {s.name for s in plan.layers if s.kind != REPLICATED} | set(plan.split_dropouts)
    return any(layer.name in names or (_nested(layer) and _splits_inside(layer, plan)) for layer in model.layers)


def _inline_inputs(inner: ModelGraph, args: tuple, kwargs: dict) -> list | None:
    """The outer values for ``inner``'s flattened inputs, if the call passes exactly its inputs."""
    if len(args) != 1 or any(v is not None for v in keras.tree.flatten(kwargs)):
        return None  # Keras passes mask=None leaves for a nested model's inputs
    given = keras.tree.flatten(args[0])  # a dict flattens by sorted key, as the model's own inputs
    return given if len(given) == len(inner.inputs) else None


def _replay(graph: ModelGraph, values: dict, plan, group: TensorGroup, shards: dict) -> None:
    for call in graph.calls:
        layer = call.layer
        args, kwargs = call.node.arguments.fill_in(values)
        if _nested(layer) and _splits_inside(layer, plan):
            inner = model_graph(layer)
            given = _inline_inputs(inner, args, kwargs)
            if given is None:
                raise TensorParallelError(
                    f"the nested model {layer.name!r} is called with other arguments than its inputs; its "
                    "layers cannot be split. plan.replicate(...) its layers, or call it on its inputs only.")
            for name, value in zip(inner.inputs, given):
                values[id(inner.keras_tensors[name])] = value
            _replay(inner, values, plan, group, shards)
            outs = [values[id(inner.keras_tensors[n])] for n in inner.outputs]
        else:
            if layer.name in plan.split_dropouts:
                layer = SliceDropout(layer, group)
            elif plan.kind(layer.name) != REPLICATED:
                if layer.name not in shards:
                    shards[layer.name] = shard_layer(layer, plan.kind(layer.name), group)
                layer = shards[layer.name]
            outs = keras.tree.flatten(layer(*args, **kwargs))
        for name, new in zip(call.outputs, outs):
            values[id(graph.keras_tensors[name])] = new


def shard_model(model: keras.Model, plan, group: TensorGroup, shards: dict) -> keras.Model:
    """``model``'s functional graph with each layer ``plan`` splits replaced by its shard
    layer on this rank of ``group`` (made once per layer, kept in ``shards`` by name) and
    every other layer reused as it is; nested models with split layers replayed inline."""
    graph = model_graph(model)
    values: dict[int, object] = {}
    inputs = []
    for j, name in enumerate(graph.inputs):
        kt = graph.keras_tensors[name]
        new = keras.Input(shape=kt.shape[1:], dtype=kt.dtype, name=graph.input_layer_names[j])
        values[id(kt)] = new
        inputs.append(new)
    _replay(graph, values, plan, group, shards)
    outputs = keras.tree.map_structure(lambda n: values[id(graph.keras_tensors[n])], graph.output_struct)
    return keras.Model(inputs=inputs, outputs=outputs, name=f"{model.name}_tp{group.rank}")


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
