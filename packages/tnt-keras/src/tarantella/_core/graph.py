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


def _is_graph_model(op) -> bool:
    """A nested model whose layer graph can be walked (functional, or a built Sequential)."""
    if isinstance(op, keras.Sequential):
        return getattr(op, "_functional", None) is not None
    return isinstance(op, keras.Model) and hasattr(op, "_nodes_by_depth") \
        and getattr(op, "_inputs_struct", None) is not None


def _nested_inputs(node, functional) -> list | None:
    """The outer tensors a nested model's call feeds to its flattened inputs, in order; None
    when the call does something Keras would adapt (masks, extra arguments, a cast, another
    rank or structure): the model is then kept as one call."""
    args, kwargs = node.arguments.args, node.arguments.kwargs
    if len(args) != 1 or any(v is not None for v in keras.tree.flatten(kwargs)):  # mask={...: None}
        return None
    given, struct = args[0], functional._inputs_struct
    if isinstance(given, dict) and not isinstance(struct, dict):
        flat_struct = keras.tree.flatten(struct)
        if not all(t.name in given for t in flat_struct):
            return None
        outer = [given[t.name] for t in flat_struct]
    else:
        outer = keras.tree.flatten(given)
        flat_struct = keras.tree.flatten(struct)
        if isinstance(given, dict) and isinstance(struct, dict) and sorted(given) != sorted(struct):
            return None
    if len(outer) != len(flat_struct):
        return None
    for o, i in zip(outer, flat_struct):
        if not hasattr(o, "_keras_history") or len(o.shape) != len(i.shape) or str(o.dtype) != str(i.dtype):
            return None
    return outer


def leaf_layers(model: keras.Model) -> list:
    """The layers holding weights, nested models' layers in their place, in the order of
    ``model.weights`` (each once): what a flattened graph's stages are made of."""
    owner: dict[int, object] = {}
    for layer in _internals.all_sublayers(model):
        if isinstance(layer, keras.Model) or not layer.weights:
            continue
        for v in layer.weights:
            owner.setdefault(id(v), layer)
    out: dict[int, object] = {}
    for v in model.weights:
        layer = owner.get(id(v))
        if layer is not None:
            out.setdefault(id(layer), layer)
    return list(out.values())


def model_graph(model: keras.Model, flatten_nested: bool = False) -> ModelGraph:
    """Analyse ``model`` (functional or built Sequential); subclassed models are refused.

    ``flatten_nested``: the calls of a nested functional model (a keras-hub backbone inside
    a task model) become calls of the graph, named ``"<nested model>/<layer>:<node>:<i>"``,
    so a partition can cut through it; its inputs and outputs are the outer tensors.
    """
    if not isinstance(model, keras.Model):
        raise PipelineError(f"pipelining needs a keras.Model, got {type(model).__name__}.")
    functional = _functional_of(model)
    tensors: dict[str, TensorInfo] = {}
    keras_tensors: dict[str, object] = {}
    alias: dict[int, str] = {}  # id(KerasTensor) -> name (a nested model's inputs/outputs: the outer one)

    def note(t, prefix: str = "") -> str:
        if id(t) in alias:
            return alias[id(t)]
        name = prefix + _tensor_name(t)
        if name not in tensors:
            tensors[name] = TensorInfo(name, tuple(t.shape[1:]), str(np.dtype(t.dtype).name)
                                       if t.dtype != "string" else "object")
            keras_tensors[name] = t
        alias[id(t)] = name
        return name

    inputs_struct, outputs_struct, nodes_by_depth, input_layer_names = _internals.functional_structure(functional)
    inputs = [note(t) for t in keras.tree.flatten(inputs_struct)]
    calls: list[Call] = []

    def walk(nodes_by_depth, prefix: str) -> None:
        for depth in sorted(nodes_by_depth.keys(), reverse=True):
            for node in nodes_by_depth[depth]:
                if not node.operation or node.is_input:
                    continue
                op = node.operation
                if flatten_nested and _is_graph_model(op):
                    inner = _functional_of(op)
                    outer = _nested_inputs(node, inner)
                    if outer is not None:
                        ins, outs, inner_nodes, _ = _internals.functional_structure(inner)
                        for o, i in zip(outer, keras.tree.flatten(ins)):
                            alias[id(i)] = note(o, prefix)
                        walk(inner_nodes, f"{prefix}{op.name}/")
                        for o, i in zip(node.outputs, keras.tree.flatten(outs)):
                            alias[id(o)] = note(i, f"{prefix}{op.name}/")
                        continue
                ins = [note(t, prefix) for t in node.arguments.keras_tensors]
                outs = [note(t, prefix) for t in node.outputs]
                calls.append(Call(len(calls), op, node, ins, outs))

    walk(nodes_by_depth, "")
    output_struct = keras.tree.map_structure(note, outputs_struct)
    outputs = [note(t) for t in keras.tree.flatten(outputs_struct)]
    for c in calls:
        if c.is_split and (len(dict.fromkeys(c.inputs)) != 1 or len(c.outputs) != 1):
            raise PipelineError(
                f"SplitLayer {c.layer.name!r} takes {len(c.inputs)} tensors; a SplitLayer marks "
                "one tensor. Put one SplitLayer on each tensor that crosses the cut."
            )
    if flatten_nested:
        layer_order = [layer.name for layer in leaf_layers(model)]
        called = {}
        for c in calls:
            other = called.setdefault(c.layer.name, c.layer)
            if other is not c.layer:
                raise PipelineError(
                    f"model {model.name!r} holds two different layers named {c.layer.name!r} "
                    "(in nested models): stages match layers by name. Give the layers unique "
                    "names (name=...).")
    else:
        layer_order = [layer.name for layer in model.layers if layer.weights]
    return ModelGraph(model.name, calls, tensors, inputs, input_layer_names, outputs,
                      output_struct, keras_tensors, layer_order)
