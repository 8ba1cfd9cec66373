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

from .._core.deferred import current_or_initial, is_deferred
from .._core.errors import PipelineError
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
    """A new layer with the same config (and name), without weights yet. A keras op node
    (``x[:, 0]``, ``keras.ops.reshape``: an Operation, no Layer) holds no state: itself."""
    if not isinstance(layer, keras.layers.Layer):
        return layer
    return layer.__class__.from_config(layer.get_config())


def _stage_layer(layer, tied: bool):
    """The clone of ``layer`` this stage runs. A layer whose config does not rebuild it
    (keras-hub 0.32's ``LlamaTransformerDecoder.get_config`` raises) runs as itself: it
    already holds this process's copy of its weights, and no other stage uses it."""
    try:
        return clone_layer(layer)
    except Exception as err:  # any failure of the layer's own config code
        if tied or any(is_deferred(v) for v in layer.weights):
            why = "it is tied across stages" if tied else "its model was built deferred"
            raise PipelineError(
                f"layer {layer.name!r} ({type(layer).__name__}) cannot be re-created from its "
                f"config ({type(err).__name__}: {err}), and {why}, so this stage cannot use the "
                "original either. Fix the layer's get_config(), or cut the model so that this "
                "layer is called on one stage of a model built ordinarily.") from err
        return layer


def _call(call: Call, layer, values: dict[str, object]):
    """Call ``layer`` as ``call`` called the original, on the stage's tensors (by name: the
    inputs of a flattened nested model are the outer tensors)."""
    by_id = {id(t): values[name] for t, name in zip(call.node.arguments.keras_tensors, call.inputs)}
    args, kwargs = call.node.arguments.fill_in(by_id)
    return layer(*args, **kwargs)


def build_stage(plan: Plan, s: int, *, copy_weights: bool = True) -> StageModel:
    """Stage ``s`` of ``plan`` as a Keras model built from clones of its layers."""
    graph = plan.graph
    stage = plan.stages[s]
    last = s == plan.num_stages - 1
    values: dict[str, object] = {}  # tensor name -> new KerasTensor
    inputs = []
    for j in stage.data_inputs:
        t = graph.keras_tensors[graph.inputs[j]]
        new = keras.Input(shape=t.shape[1:], dtype=t.dtype, name=graph.input_layer_names[j])
        values[graph.inputs[j]] = new
        inputs.append(new)
    for b in stage.inputs:
        bd = plan.boundaries[b]
        t = graph.keras_tensors[bd.tensor]
        new = keras.Input(shape=t.shape[1:], dtype=t.dtype, name=f"tnt_boundary_{b}")
        values[bd.tensor] = new
        inputs.append(new)
    for call in graph.calls:  # SplitLayers of earlier stages: their outputs are our inputs
        if call.is_split and call.inputs[0] in values:
            values[call.outputs[0]] = values[call.inputs[0]]
    tied = {t.layer for t in plan.ties}
    clones: dict[int, keras.layers.Layer] = {}
    originals: dict[int, keras.layers.Layer] = {}
    for c in stage.calls:
        call = graph.calls[c]
        if call.is_split:  # identity: its output is its input
            values[call.outputs[0]] = values[call.inputs[0]]
            continue
        key = id(call.layer)
        if key not in clones:
            clones[key] = _stage_layer(call.layer, call.layer.name in tied)
            originals[key] = call.layer
        result = keras.tree.flatten(_call(call, clones[key], values))
        for name, new in zip(call.outputs, result):
            values[name] = new

    def resolve(name: str):
        return values[name]

    if last:
        outputs = keras.tree.map_structure(resolve, graph.output_struct)
    else:
        outputs = [resolve(plan.boundaries[b].tensor) for b in stage.outputs]
    model = keras.Model(inputs=inputs, outputs=outputs, name=f"{graph.model_name}_stage{s}")
    # Layers whose outputs reach no output (BERT's pooler under a head reading the sequence
    # output) are not in the functional model; held as an attribute their weights are still
    # the stage's (trained with zero gradient, as serial Keras leaves them; saved).
    model.tnt_unused_layers = [c for c in clones.values() if isinstance(c, keras.layers.Layer)
                               and c.weights and all(c is not m for m in model.layers)]
    if copy_weights:  # deferred originals (deferred_variables) give their initial values
        for key, clone in clones.items():
            if clone is originals[key]:  # an op node, or a layer that runs as itself
                continue
            for var, original in zip(clone.weights, originals[key].weights):
                var.assign(current_or_initial(original))
    return StageModel(s, model, stage.data_inputs, stage.inputs, stage.outputs, last)


class ChunkStack(keras.Model):
    """The chunks one stage holds under the interleaved schedule, as one Keras model: its
    variables are the chunks' in chunk order (what the stage's optimizer updates, saves and
    loads); it is never called (the executor runs each chunk's own model)."""

    def __init__(self, chunks: list[keras.Model], name: str) -> None:
        super().__init__(name=name)
        self.tnt_chunks = list(chunks)
        self.built = True

    def call(self, *args, **kwargs):  # pragma: no cover - the executor runs the chunks
        raise TypeError("a ChunkStack is not called: run each of its tnt_chunks")


def build_chunks(plan: Plan, stage: int, num_stages: int) -> list[StageModel]:
    """The chunks ``stage``, ``stage + p``, ``stage + 2p`` ... of an interleaved ``plan``
    (whose stages are the p * v chunks)."""
    return [build_stage(plan, c) for c in range(stage, plan.num_stages, num_stages)]


def held_layers(model: keras.Model) -> list:
    """A stage model's layers, those whose outputs reach none of its outputs included (of
    each chunk of a ``ChunkStack``)."""
    chunks = getattr(model, "tnt_chunks", None)
    if chunks is not None:
        return [layer for chunk in chunks for layer in held_layers(chunk)]
    return [*model.layers, *getattr(model, "tnt_unused_layers", ())]


def serial_weights(plan: Plan, stage_models) -> list:
    """The weights of all stages (layer by layer) in the serial model's get_weights() order."""
    owner = {}
    for model in stage_models:
        for layer in held_layers(model):
            owner[layer.name] = layer
    out = []
    for name in plan.graph.layer_order:
        if name not in owner:
            raise KeyError(f"layer {name!r} is in none of the given stages")
        out.extend(owner[name].get_weights())
    return out
