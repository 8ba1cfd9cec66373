"""Build one pipeline stage as its own ``keras.Model``, holding only that stage's layers.

Each layer of the stage is re-created from its config (so the stage never references the
user's model and the rest of the model can be freed) and called on fresh ``keras.Input``s
for the stage's inputs, in the model's execution order; the weights are then copied
from the original layers, so stage s starts exactly where the serial model starts. The
original model may be deferred (``deferred_variables``): it then holds no memory for its
weights, and only the stage's variables are ever created on this rank.

Stage model signature (all stages): inputs = [model inputs it reads (in the model's
order)] + [boundary tensors it receives (by boundary index)]; outputs = the boundary
tensors it produces (by boundary index), or for the last stage the model's outputs, in
the model's output structure (so compile(loss=..., metrics=...) is the user's own).
"""

from __future__ import annotations

from dataclasses import dataclass

import keras

from .._core.deferred import current_or_initial
from .._core.graph import Call
from ._plan import Plan


@dataclass
class StageModel:
    """A stage's Keras model and what its inputs and outputs mean."""

    index: int
    model: keras.Model
    data_inputs: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    is_last: bool


def clone_layer(layer: keras.layers.Layer) -> keras.layers.Layer:
    """A new layer with the same config (and name), without weights yet."""
    return layer.__class__.from_config(layer.get_config())


def _call(call: Call, layer, values: dict[int, object]):
    args, kwargs = call.node.arguments.fill_in(values)
    return layer(*args, **kwargs)


def build_stage(plan: Plan, s: int, *, copy_weights: bool = True) -> StageModel:
    """Stage ``s`` of ``plan`` as a Keras model built from clones of its layers."""
    graph = plan.graph
    stage = plan.stages[s]
    last = s == plan.num_stages - 1
    values: dict[int, object] = {}  # id(original KerasTensor) -> new KerasTensor
    inputs = []
    for j in stage.data_inputs:
        t = graph.keras_tensors[graph.inputs[j]]
        new = keras.Input(shape=t.shape[1:], dtype=t.dtype, name=graph.input_layer_names[j])
        values[id(t)] = new
        inputs.append(new)
    for b in stage.inputs:
        bd = plan.boundaries[b]
        t = graph.keras_tensors[bd.tensor]
        new = keras.Input(shape=t.shape[1:], dtype=t.dtype, name=f"tnt_boundary_{b}")
        values[id(t)] = new
        inputs.append(new)
    for call in graph.calls:  # SplitLayers of earlier stages: their outputs are our inputs
        src, out = (graph.keras_tensors[call.inputs[0]], graph.keras_tensors[call.outputs[0]]) \
            if call.is_split else (None, None)
        if src is not None and id(src) in values:
            values[id(out)] = values[id(src)]
    clones: dict[int, keras.layers.Layer] = {}
    originals: dict[int, keras.layers.Layer] = {}
    for c in stage.calls:
        call = graph.calls[c]
        if call.is_split:  # identity: its output is its input
            src = graph.keras_tensors[call.inputs[0]]
            out = graph.keras_tensors[call.outputs[0]]
            values[id(out)] = values[id(src)]
            continue
        key = id(call.layer)
        if key not in clones:
            clones[key] = clone_layer(call.layer)
            originals[key] = call.layer
        result = keras.tree.flatten(_call(call, clones[key], values))
        for name, new in zip(call.outputs, result):
            values[id(graph.keras_tensors[name])] = new

    def resolve(name: str):
        return values[id(graph.keras_tensors[name])]

    if last:
        outputs = keras.tree.map_structure(resolve, graph.output_struct)
    else:
        outputs = [resolve(plan.boundaries[b].tensor) for b in stage.outputs]
    model = keras.Model(inputs=inputs, outputs=outputs, name=f"{graph.model_name}_stage{s}")
    if copy_weights:  # deferred originals (deferred_variables) give their initial values
        for key, clone in clones.items():
            for var, original in zip(clone.weights, originals[key].weights):
                var.assign(current_or_initial(original))
    return StageModel(s, model, stage.data_inputs, stage.inputs, stage.outputs, last)


def serial_weights(plan: Plan, stage_models) -> list:
    """The weights of all stages (layer by layer) in the serial model's get_weights() order."""
    owner = {}
    for model in stage_models:
        for layer in model.layers:
            owner[layer.name] = layer
    out = []
    for name in plan.graph.layer_order:
        if name not in owner:
            raise KeyError(f"layer {name!r} is in none of the given stages")
        out.extend(owner[name].get_weights())
    return out
