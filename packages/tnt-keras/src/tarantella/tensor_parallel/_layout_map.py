"""``tensor_parallel_plan=``: a Plan (automatic or edited) or a Keras ``LayoutMap``.

A ``keras.distribution.LayoutMap`` maps regular expressions over variable paths
(``"ffn_up/kernel"``, ``"mha/query/kernel"``) to a layout per dimension: an axis name or
None. The tensor axis is ``"model"``; None (or a path no key matches) keeps the dimension
whole. Each layer's layouts must be one of the patterns the shard layers implement:

    Dense               kernel (None, "model"), bias ("model",) or whole  -> column
                        kernel ("model", None), bias whole                -> row
    Embedding           embeddings ("model", None)                        -> vocab
    MultiHeadAttention  query/key/value kernel (None, "model", None), their biases
                        ("model", None) or whole, attention_output kernel
                        ("model", None, None), its bias whole             -> heads
    any layer           every variable whole                              -> replicated

A column Dense whose output reaches a row Dense through elementwise layers becomes the
"column" half of that pair; any other column Dense "column+allgather". The resulting kinds
then pass the same checks as an edited plan (``plan_from_kinds``).
"""

from __future__ import annotations

import keras

from .._core.errors import TensorParallelError
from .._core.graph import model_graph
from ._plan import (
    COLUMN,
    COLUMN_GATHER,
    HEADS,
    REPLICATED,
    ROW,
    SPLIT_AXES,
    SUPPORTED,
    VOCAB,
    Plan,
    _row_partner,
    _uses,
    plan,
    plan_from_kinds,
    var_name,
)

MODEL_AXIS = "model"

#: kind -> (variables that must be split on the axis given, variables that may be)
_PATTERNS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    COLUMN: ({"kernel": 1}, {"bias": 0}),
    ROW: ({"kernel": 0}, {}),
    VOCAB: ({"embeddings": 0}, {}),
    HEADS: ({k: a for k, a in SPLIT_AXES[HEADS].items() if k.endswith("kernel")},
            {k: a for k, a in SPLIT_AXES[HEADS].items() if k.endswith("bias")}),
}
_CLASS_KINDS = {"Dense": (COLUMN, ROW), "Embedding": (VOCAB,), "MultiHeadAttention": (HEADS,)}


def _split_axes(layer, layout_map) -> dict[str, int]:
    """{variable name in ``layer``: dimension on the "model" axis} from ``layout_map``."""
    out = {}
    for w in layer.weights:
        try:
            layout = layout_map[w.path]
        except ValueError as err:  # the path matches several keys
            raise TensorParallelError(f"layer {layer.name!r}: {err}") from None
        axes = tuple(getattr(layout, "axes", layout) or ()) if layout is not None else ()
        if axes and len(axes) != len(w.shape):
            raise TensorParallelError(
                f"layer {layer.name!r}: the LayoutMap gives {w.path} the layout {axes}, but the variable has "
                f"{len(w.shape)} dimensions {tuple(w.shape)}; give one entry (an axis name or None) per dimension.")
        unknown = [a for a in axes if a not in (None, MODEL_AXIS)]
        if unknown or axes.count(MODEL_AXIS) > 1:
            raise TensorParallelError(
                f"layer {layer.name!r}: the LayoutMap gives {w.path} the layout {axes}; a variable may be split "
                f"along one dimension only, on the tensor axis {MODEL_AXIS!r} (None keeps a dimension whole). "
                "Data-parallel axes ('batch') are not part of a variable's layout.")
        if MODEL_AXIS in axes:
            out[var_name(w, layer)] = axes.index(MODEL_AXIS)
    return out


def _kind_of(layer, split: dict[str, int]) -> str:
    """The kind whose pattern ``split`` is, or a TensorParallelError naming the layer."""
    if not split:
        return REPLICATED
    for kind in _CLASS_KINDS.get(type(layer).__name__, ()):
        if type(layer) is not getattr(keras.layers, type(layer).__name__):
            break  # a subclass of a Keras layer: its call may differ
        required, optional = _PATTERNS[kind]
        if all(split.get(k) == a for k, a in required.items()) and \
                all(k in required or optional.get(k) == a for k, a in split.items()):
            return kind
    raise TensorParallelError(
        f"layer {layer.name!r} ({type(layer).__name__}): the LayoutMap splits {split} (variable: dimension on "
        f"{MODEL_AXIS!r}), which is not a supported pattern. {SUPPORTED}; as layouts: Dense kernel (None, "
        "'model') = column, ('model', None) = row; Embedding embeddings ('model', None); MultiHeadAttention "
        "query/key/value kernels (None, 'model', None) with attention_output kernel ('model', None, None).")


def from_layout_map(layout_map, model: keras.Model, tensor_parallel_size: int) -> Plan:
    """The plan a ``keras.distribution.LayoutMap`` describes for ``model`` (see module doc)."""
    mesh = getattr(layout_map, "device_mesh", None)
    if mesh is not None and MODEL_AXIS in mesh.axis_names:
        size = mesh.shape[list(mesh.axis_names).index(MODEL_AXIS)]
        if size != tensor_parallel_size:
            raise TensorParallelError(
                f"the LayoutMap's DeviceMesh has {size} devices on the {MODEL_AXIS!r} axis but "
                f"tensor_parallel_size={tensor_parallel_size}; make them agree.")
    kinds = {}
    for layer in model.layers:
        kind = _kind_of(layer, _split_axes(layer, layout_map)) if layer.weights else REPLICATED
        if kind != REPLICATED:
            kinds[layer.name] = kind
    graph = model_graph(model)
    uses = _uses(graph)
    for call in graph.calls:  # a column Dense is a pair's first half only if a row Dense follows
        name = call.layer.name
        if kinds.get(name) == COLUMN:
            row, _ = _row_partner(graph, call.index, uses)
            if row is None or kinds.get(graph.calls[row].layer.name) != ROW:
                kinds[name] = COLUMN_GATHER
    return plan_from_kinds(model, tensor_parallel_size, kinds,
                           {name: "from the LayoutMap" for name in kinds})


def as_plan(value, model: keras.Model, tensor_parallel_size: int) -> Plan:
    """``tensor_parallel_plan=`` as a Plan checked against ``model``: None (automatic),
    a Plan (automatic or edited) or a ``keras.distribution.LayoutMap``."""
    t = tensor_parallel_size
    if value is None:
        return plan(model, t)
    if isinstance(value, keras.distribution.LayoutMap):
        return from_layout_map(value, model, t)
    if not isinstance(value, Plan):
        raise TensorParallelError(
            f"tensor_parallel_plan must be a tnt.tensor_parallel.Plan or a keras.distribution.LayoutMap, got "
            f"{type(value).__name__}.")
    if value.tensor_parallel_size != t:
        raise TensorParallelError(
            f"tensor_parallel_plan was made for tensor_parallel_size={value.tensor_parallel_size} "
            f"but tensor_parallel_size={t}; make them agree.")
    if value.model_name != model.name:
        raise TensorParallelError(f"tensor_parallel_plan is the plan of model {value.model_name!r}, "
                                  f"not of {model.name!r}; make the plan from this model.")
    # Checked against this model (an edited or hand-made plan may name any split).
    return plan_from_kinds(model, t, value.split_layers(), {s.name: s.note for s in value.layers})
