"""``tensor_parallel_plan=``: a Plan (automatic or edited) or a Keras ``LayoutMap``.

A ``keras.distribution.LayoutMap`` maps regular expressions over variable paths
(``"ffn_up/kernel"``, ``"mha/query/kernel"``) to a layout per dimension: an axis name or
None. The tensor axis is ``"model"``; None (or a path no key matches) keeps the dimension
whole. Each layer's layouts must be one of the patterns the shard layers implement:

    Dense (or an EinsumDense "abc,cd->abd")
                        kernel (None, "model"), bias ("model",) or whole  -> column
                        kernel ("model", None), bias whole                -> row
    Embedding           embeddings ("model", None)                        -> vocab
    MultiHeadAttention  query/key/value kernel (None, "model", None), their biases
                        ("model", None) or whole, attention_output kernel
                        ("model", None, None), its bias whole             -> heads
    ReversibleEmbedding embeddings ("model", None), any reverse_embeddings   -> vocab
    CachedMultiHeadAttention  as MultiHeadAttention                        -> heads
    keras-hub TransformerEncoder/Decoder  any variable on "model"          -> block
    keras-hub LlamaTransformerDecoder or GemmaDecoderBlock  an attention variable on "model", query and
                        key/value heads divisible by t                  -> block
                        else any variable on "model"                    -> ffn
    other keras-hub layers  any variable on "model": kept whole, noted in the plan
    any layer           every variable whole                              -> replicated

The mesh's other axes (keras-hub's ``get_layout_map`` names its data axis "batch"; without
a mesh, "batch") are data parallelism: tnt runs them as data replicas, so a dimension on
them is whole on a rank.

A column Dense whose output reaches a row Dense through elementwise layers becomes the
"column" half of that pair; any other column Dense "column+allgather". The resulting kinds
then pass the same checks as an edited plan (``plan_from_kinds``).
"""

from __future__ import annotations

import keras

from .._core.errors import TensorParallelError
from .._core.log import logger
from ._families import block_parts
from ._plan import (
    BLOCK,
    COLUMN,
    COLUMN_GATHER,
    FFN,
    HEADS,
    REPLICATED,
    ROW,
    SPLIT_AXES,
    SUPPORTED,
    VOCAB,
    Plan,
    _block_refusal,
    _row_partner,
    flatten,
    is_attention,
    is_block,
    is_dense,
    is_ffn_block,
    is_vocab_embedding,
    plan,
    plan_from_kinds,
    var_name,
)

MODEL_AXIS = "model"
DATA_AXIS = "batch"  # keras-hub's get_layout_map(..., data_parallel_dim_name="batch")

#: kind -> (variables that must be split on the axis given, variables that may be)
_PATTERNS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    COLUMN: ({"kernel": 1}, {"bias": 0}),
    ROW: ({"kernel": 0}, {}),
    VOCAB: ({"embeddings": 0}, {}),
    HEADS: ({k: a for k, a in SPLIT_AXES[HEADS].items() if k.endswith("kernel")},
            {k: a for k, a in SPLIT_AXES[HEADS].items() if k.endswith("bias")}),
}
_CLASS_KINDS = {"Dense": (COLUMN, ROW), "Embedding": (VOCAB,), "MultiHeadAttention": (HEADS,)}


def _data_axes(layout_map) -> set[str]:
    """The axes of the LayoutMap's mesh other than "model" (keras-hub's "batch"): data
    parallelism, which tnt runs as replicas (a variable is whole along them on a rank)."""
    mesh = getattr(layout_map, "device_mesh", None)
    return {a for a in mesh.axis_names if a != MODEL_AXIS} if mesh is not None else {DATA_AXIS}


def _split_axes(layer, layout_map) -> dict[str, int]:
    """{variable name in ``layer``: dimension on the "model" axis} from ``layout_map``."""
    out = {}
    data = _data_axes(layout_map)
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
        axes = tuple(None if a in data else a for a in axes)  # data axes: whole on a rank (replicas)
        unknown = [a for a in axes if a not in (None, MODEL_AXIS)]
        if unknown or axes.count(MODEL_AXIS) > 1:
            raise TensorParallelError(
                f"layer {layer.name!r}: the LayoutMap gives {w.path} the layout {axes}; a variable may be split "
                f"along one dimension only, on the tensor axis {MODEL_AXIS!r} (None keeps a dimension whole). "
                f"The data axes {sorted(data)} (tnt's data replicas: the variable is whole on each) are the "
                "mesh's other axes, or 'batch' without a mesh.")
        if MODEL_AXIS in axes:
            out[var_name(w, layer)] = axes.index(MODEL_AXIS)
    return out


def _kind_of(layer, split: dict[str, int], tensor_parallel_size: int) -> str:
    """The kind whose pattern ``split`` is, or a TensorParallelError naming the layer."""
    if not split:
        return REPLICATED
    if is_block(layer):  # any of its variables on "model": the block is split as tnt splits one
        return BLOCK
    if is_ffn_block(layer):  # Llama, Gemma: attention by heads too when the map splits it and t divides the heads
        on_attention = any(k.startswith(f"{block_parts(layer).attention_path}/") for k in split)
        return BLOCK if on_attention and not _block_refusal(layer, tensor_parallel_size, ()) else FFN
    kinds = _CLASS_KINDS.get(type(layer).__name__, ())
    if is_dense(layer):  # an EinsumDense "abc,cd->abd" too
        kinds = (COLUMN, ROW)
    if is_vocab_embedding(layer):
        kinds = (VOCAB,)
    elif is_attention(layer):
        kinds = (HEADS,)
    elif type(layer).__module__.startswith("keras_hub."):
        return REPLICATED  # a keras-hub layer tnt cannot split (noted by from_layout_map)
    for kind in kinds:
        if type(layer) is not getattr(keras.layers, type(layer).__name__, None) and kind in (COLUMN, ROW):
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
    kinds, notes = {}, {}
    flat = flatten(model)
    for layer in flat.layers:
        split = _split_axes(layer, layout_map)
        kind = _kind_of(layer, split, tensor_parallel_size)
        if kind != REPLICATED:
            kinds[layer.name] = kind
            notes[layer.name] = "from the LayoutMap" + (" (a Transformer block: attention by heads, FFN "
                                                        "column/row)" if kind == BLOCK else "")
        elif split:
            notes[layer.name] = (f"the LayoutMap splits {sorted(split)}, but tnt has no split for a "
                                 f"{type(layer).__name__}: kept whole")
    for graph in flat.graphs:  # a column Dense is a pair's first half only if a row Dense follows
        for call in graph.calls:
            name = call.layer.name
            if kinds.get(name) == COLUMN:
                row, _ = _row_partner(graph, call.index, flat.uses)
                if row is None or kinds.get(graph.calls[row].layer.name) != ROW:
                    kinds[name] = COLUMN_GATHER
    return plan_from_kinds(model, tensor_parallel_size, kinds, notes)


def as_plan(value, model: keras.Model, tensor_parallel_size: int) -> Plan:
    """``tensor_parallel_plan=`` as a Plan checked against ``model``: None (automatic),
    a Plan (automatic or edited) or a ``keras.distribution.LayoutMap``. Logs the plan's
    warning when more than 20 % of the bytes stay replicated."""
    made = _as_plan(value, model, tensor_parallel_size)
    if made.replicated_warning():
        logger.warning("tensor-parallel plan: %s", made.replicated_warning())
    return made


def _as_plan(value, model: keras.Model, tensor_parallel_size: int) -> Plan:
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
