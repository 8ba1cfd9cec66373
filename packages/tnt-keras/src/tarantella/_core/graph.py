"""The call graph of a functional or Sequential Keras model, in execution order.

Partitioning works on *calls* (one application of a layer to its inputs), not on layers:
a layer called twice appears twice, and a partition must keep both calls in one stage.
Tensors are named ``"<layer>:<node>:<index>"`` after Keras' own history, so names are
stable across processes and readable in error messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import keras
import numpy as np

from . import internals as _internals
from .errors import PipelineError
from .split_layer import SplitLayer


@dataclass(frozen=True)
class TensorInfo:
    """A symbolic tensor of the model: name, shape without the batch axis, dtype."""

    name: str
    shape: tuple
    dtype: str

    @property
    def nbytes_per_sample(self) -> int:
        count = int(np.prod([d if d is not None else 1 for d in self.shape], dtype=np.int64))
        return count * np.dtype(self.dtype).itemsize

    @property
    def differentiable(self) -> bool:
        return np.dtype(self.dtype).kind == "f"


@dataclass
class Call:
    """One call of a layer: its position, the layer, and the tensors in and out."""

    index: int
    layer: keras.layers.Layer
    node: object
    inputs: list[str]
    outputs: list[str]

    @property
    def is_split(self) -> bool:
        return isinstance(self.layer, SplitLayer)


@dataclass
class ModelGraph:
    """Calls in a valid execution order plus the model's inputs and outputs."""

    model_name: str
    calls: list[Call]
    tensors: dict[str, TensorInfo]
    inputs: list[str]  # flattened model inputs, in the order tree.flatten gives the data
    input_layer_names: list[str]
    outputs: list[str]  # flattened model outputs
    output_struct: object  # model outputs' structure with tensor names as leaves
    keras_tensors: dict[str, object] = field(default_factory=dict)
    layer_order: list[str] = field(default_factory=list)  # model.layers' names (weights order)

    def producer(self) -> dict[str, int]:
        """Tensor name -> index of the call producing it (model inputs are absent)."""
        return {t: c.index for c in self.calls for t in c.outputs}

    def consumers(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for c in self.calls:
            for t in dict.fromkeys(c.inputs):
                out.setdefault(t, []).append(c.index)
        return out


def _tensor_name(tensor) -> str:
    history = getattr(tensor, "_keras_history", None)
    if history is None:
        raise PipelineError(f"tensor {tensor!r} has no Keras history; is the model functional?")
    op, node_index, tensor_index = history
    return f"{op.name}:{node_index}:{tensor_index}"


def _functional_of(model: keras.Model):
    if isinstance(model, keras.Sequential):
        functional = getattr(model, "_functional", None)
        if functional is None:
            raise PipelineError(
                f"The Sequential model {model.name!r} is not built, so its layers' shapes are "
                "unknown. Start it with keras.Input(shape) (or call model.build(input_shape)) "
                "before pipelining it."
            )
        return functional
    if not hasattr(model, "_nodes_by_depth") or getattr(model, "_inputs_struct", None) is None:
        raise PipelineError(
            f"{type(model).__name__} {model.name!r} is a subclassed model: its call() is Python "
            "code whose layer graph cannot be cut into pipeline stages. Build it with the "
            "functional API (keras.Model(inputs, outputs)) or keras.Sequential, or train it "
            "with tnt.ParallelStrategy.DATA."
        )
    return model


def model_graph(model: keras.Model) -> ModelGraph:
    """Analyse ``model`` (functional or built Sequential); subclassed models are refused."""
    if not isinstance(model, keras.Model):
        raise PipelineError(f"pipelining needs a keras.Model, got {type(model).__name__}.")
    functional = _functional_of(model)
    tensors: dict[str, TensorInfo] = {}
    keras_tensors: dict[str, object] = {}

    def note(t) -> str:
        name = _tensor_name(t)
        if name not in tensors:
            tensors[name] = TensorInfo(name, tuple(t.shape[1:]), str(np.dtype(t.dtype).name)
                                       if t.dtype != "string" else "object")
            keras_tensors[name] = t
        return name

    inputs_struct, outputs_struct, nodes_by_depth, input_layer_names = _internals.functional_structure(functional)
    inputs = [note(t) for t in keras.tree.flatten(inputs_struct)]
    calls: list[Call] = []
    for depth in sorted(nodes_by_depth.keys(), reverse=True):
        for node in nodes_by_depth[depth]:
            if not node.operation or node.is_input:
                continue
            ins = [note(t) for t in node.arguments.keras_tensors]
            outs = [note(t) for t in node.outputs]
            calls.append(Call(len(calls), node.operation, node, ins, outs))
    output_struct = keras.tree.map_structure(note, outputs_struct)
    outputs = [note(t) for t in keras.tree.flatten(outputs_struct)]
    for c in calls:
        if c.is_split and (len(dict.fromkeys(c.inputs)) != 1 or len(c.outputs) != 1):
            raise PipelineError(
                f"SplitLayer {c.layer.name!r} takes {len(c.inputs)} tensors; a SplitLayer marks "
                "one tensor. Put one SplitLayer on each tensor that crosses the cut."
            )
    layer_order = [layer.name for layer in model.layers if layer.weights]
    return ModelGraph(model.name, calls, tensors, inputs, input_layer_names, outputs,
                      output_struct, keras_tensors, layer_order)
