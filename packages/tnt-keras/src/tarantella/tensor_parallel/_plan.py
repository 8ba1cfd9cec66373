"""Which layers of a Keras model split over a tensor group, and how.

The plan is a pure function of the model and ``tensor_parallel_size``, so every rank
computes the same one without talking. Rules (docs/architecture.md, "Layer parallelism"):

- ``Dense -> (elementwise layers) -> Dense``: the first column-split, the second
  row-split: one SUM-allreduce forward (g after the second), one backward (f before the
  first), and the activations between them stay split.
- a lone ``Dense`` with at least ``min_split_params`` weights: column-split, outputs
  joined by an allgather before the activation.
- ``Embedding`` / ``ReversibleEmbedding``: vocabulary rows per rank, masked lookup,
  SUM-allreduce (a reverse projection: vocabulary columns, allgather).
- ``MultiHeadAttention`` / keras-hub ``CachedMultiHeadAttention``: by heads.
- keras-hub ``TransformerEncoder``/``TransformerDecoder``: Megatron's block (attention by
  heads, FFN column/row); ``LlamaTransformerDecoder`` too (grouped-query attention by
  query and key/value heads, gated FFN column/row) and Gemma's ``GemmaDecoderBlock``
  (heads-first grouped-query attention by heads, ``gating_ffw``/``gating_ffw_2`` column,
  ``ffw_linear`` row), or, when their head counts do not divide by t, their gated FFN only
  (``ffn``, with a warning naming why).
- a Keras ``EinsumDense`` whose equation is a plain projection of the last axis
  (``"abc,cd->abd"``, ``"ab,bc->ac"``, ``"...b,bc->...c"``; bias on the output axis or
  none) is a Dense for all the rules above (``is_dense``).
- anything else: replicated (same inputs on every rank, so same gradients), listed with
  its bytes; more than 20 % of the bytes replicated is warned about.

Nested functional models (a keras-hub backbone inside a task model) are opened: their
layers are planned one by one (``flatten``).

A layer is replicated, with a note saying why, when its split dimension does not divide
by t, when it is called more than once, when it has a regulariser or constraint (their
values on a shard are not the shard of the serial value), or when it is smaller than
``min_split_params``.

A plan can be edited (``Plan.replicate``, ``Plan.split``) or made from explicit kinds
(``plan_from_kinds``, also what a ``keras.distribution.LayoutMap`` becomes); either way
each split is checked against the model, and one that is not a supported pattern is an
error naming the layer and the patterns (``SUPPORTED``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import keras
import numpy as np

from .._core import internals as _internals
from .._core.errors import TensorParallelError
from .._core.graph import ModelGraph, model_graph
from .._core.log import logger
from ._families import block_parts
from ._gemma import gemma_refusal
from ._gqa import gqa_refusal

#: Lone layers below this many weights are not worth a collective per step.
DEFAULT_MIN_SPLIT_PARAMS = 1 << 16

COLUMN = "column"            # split outputs, feeding a row-split Dense
ROW = "row"                  # split inputs, SUM-allreduce of the outputs
COLUMN_GATHER = "column+allgather"
VOCAB = "vocab"
HEADS = "heads"
BLOCK = "block"              # a keras-hub Transformer block: attention by heads, FFN column/row
FFN = "ffn"                  # a keras-hub Llama/Gemma block whose heads do not divide by t: its gated FFN only
REPLICATED = "replicated"
KINDS = (COLUMN, ROW, COLUMN_GATHER, VOCAB, HEADS, BLOCK, FFN, REPLICATED)

#: More than this share of the weights' bytes left replicated is worth a warning.
REPLICATED_WARNING = 0.20

_ATTENTION_AXES = {"query/kernel": 1, "query/bias": 0, "key/kernel": 1, "key/bias": 0,
                   "value/kernel": 1, "value/bias": 0, "attention_output/kernel": 0}
#: Gemma's block: heads-first attention kernels (heads on axis 0), gated FFN column/column/row
_GEMMA_FFN_AXES = {"ffw_gating/kernel": 1, "ffw_gating_2/kernel": 1, "ffw_linear/kernel": 0}
_GEMMA_AXES = {**{f"attention/{p}/kernel": 0 for p in ("query", "key", "value", "attention_output")},
               **_GEMMA_FFN_AXES}

#: kind -> {variable path inside the layer: axis it is split along}; others are replicated.
SPLIT_AXES: dict[str, dict[str, int]] = {
    COLUMN: {"kernel": 1, "bias": 0},
    COLUMN_GATHER: {"kernel": 1, "bias": 0},
    ROW: {"kernel": 0},
    VOCAB: {"embeddings": 0, "reverse_embeddings": 1},
    HEADS: dict(_ATTENTION_AXES),
    # keras-hub's TransformerDecoder names its attention "self_attention", the encoder
    # "self_attention_layer"; both name their FFN "feedforward_intermediate/output_dense".
    BLOCK: {**{f"{a}/{k}": v for a in ("self_attention", "self_attention_layer")
               for k, v in _ATTENTION_AXES.items()},
            "feedforward_intermediate_dense/kernel": 1, "feedforward_intermediate_dense/bias": 0,
            "feedforward_output_dense/kernel": 0,
            # Llama's gated FFN (its attention is "self_attention", with the same variable names)
            "feedforward_gate_dense/kernel": 1, "feedforward_gate_dense/bias": 0, **_GEMMA_AXES},
    FFN: {"feedforward_intermediate_dense/kernel": 1, "feedforward_intermediate_dense/bias": 0,
          "feedforward_gate_dense/kernel": 1, "feedforward_gate_dense/bias": 0, "feedforward_output_dense/kernel": 0,
          **_GEMMA_FFN_AXES},
    REPLICATED: {},
}
#: kind -> (SUM-allreduce or allgather forward, allreduce backward) per step.
COLLECTIVES: dict[str, tuple[int, int]] = {
    COLUMN: (0, 1), ROW: (1, 0), COLUMN_GATHER: (1, 1), VOCAB: (1, 0), HEADS: (1, 1), BLOCK: (2, 2), FFN: (1, 2),
    REPLICATED: (0, 0),
}

#: The patterns a split must follow (named in every error about an unsupported split).
SUPPORTED = (
    "supported splits (a Dense: keras.layers.Dense, or an EinsumDense projecting the last axis such as "
    "'abc,cd->abd'): a Dense 'column' feeding a Dense 'row' through elementwise layers only "
    "(activations, Dropout); a lone Dense 'column+allgather'; an Embedding or ReversibleEmbedding "
    "'vocab' (rows; a tied reverse projection by vocabulary columns); a MultiHeadAttention or keras-hub "
    "CachedMultiHeadAttention 'heads' (Q/K/V by heads, output projection by rows); a keras-hub "
    "TransformerEncoder/TransformerDecoder without cross-attention 'block' (its attention by heads, its "
    "feed-forward Dense pair column/row); a keras-hub LlamaTransformerDecoder 'block' (its grouped-query "
    "attention by query and key/value heads, both counts divisible by t; its gated feed-forward column/row) "
    "or 'ffn' (its gated feed-forward only, its attention whole); a keras-hub GemmaDecoderBlock the same "
    "(its CachedGemmaAttention by heads, ffw_gating/ffw_gating_2 column, ffw_linear row); any layer "
    "'replicated'")
_DENSE = "keras.layers.Dense or an EinsumDense projecting the last axis ('abc,cd->abd')"
_LAYER_CLASS = {COLUMN: _DENSE, ROW: _DENSE, COLUMN_GATHER: _DENSE,
                VOCAB: "keras.layers.Embedding or a ReversibleEmbedding",
                HEADS: "keras.layers.MultiHeadAttention or keras-hub's CachedMultiHeadAttention",
                BLOCK: "keras-hub TransformerEncoder, TransformerDecoder, LlamaTransformerDecoder or "
                       "GemmaDecoderBlock",
                FFN: "keras-hub LlamaTransformerDecoder or GemmaDecoderBlock"}
_HUB = "keras_hub."


def _hub(layer, *names: str) -> bool:
    """``layer`` is exactly one of keras-hub's classes ``names`` (a subclass's call may differ)."""
    cls = type(layer)
    return cls.__name__ in names and cls.__module__.startswith(_HUB)


def is_attention(layer) -> bool:
    """Keras' MultiHeadAttention or keras-hub's CachedMultiHeadAttention (the same projections)."""
    return type(layer) is keras.layers.MultiHeadAttention or _hub(layer, "CachedMultiHeadAttention")


def is_vocab_embedding(layer) -> bool:
    """An Embedding, or a ReversibleEmbedding (Keras' or keras-hub's, whose reverse call is known)."""
    reversible = getattr(keras.layers, "ReversibleEmbedding", None)
    return type(layer) is keras.layers.Embedding or (reversible is not None and type(layer) is reversible) \
        or _hub(layer, "ReversibleEmbedding")


def is_block(layer) -> bool:
    """keras-hub's TransformerEncoder or TransformerDecoder."""
    return _hub(layer, "TransformerEncoder", "TransformerDecoder")


def is_ffn_block(layer) -> bool:
    """keras-hub's Llama or Gemma decoder block (gated FFN, grouped-query attention)."""
    parts = block_parts(layer)
    return parts is not None and parts.gated


def plain_projection(equation: str, bias_axes: str | None) -> bool:
    """An EinsumDense equation that is a Dense: ``<x>c,cd-><x>d`` (``x`` any other axes,
    ``...`` included), bias on ``d`` or none."""
    try:
        lhs, rest = equation.replace(" ", "").split(",")
        kernel, out = rest.split("->")
    except ValueError:
        return False
    if len(kernel) != 2 or not lhs or kernel[0] == kernel[1]:
        return False
    c, d = kernel
    return (lhs[-1] == c and c not in lhs[:-1] and d not in lhs and out == lhs[:-1] + d
            and (bias_axes or "") in ("", d))


def is_dense(layer) -> bool:
    """A Keras Dense, or a Keras EinsumDense that is one (``plain_projection``, built)."""
    if type(layer) is keras.layers.Dense:
        return True
    return (type(layer) is keras.layers.EinsumDense and getattr(layer, "built", False)
            and len(layer.kernel.shape) == 2 and plain_projection(layer.equation, layer.bias_axes))


def dense_units(layer) -> int:
    """The outputs of a Dense (``is_dense``): its kernel's columns."""
    return int(layer.kernel.shape[1])


def is_gqa_attention(layer) -> bool:
    """keras-hub's LlamaAttention (grouped-query attention with rotary embeddings)."""
    return _hub(layer, "LlamaAttention")


def is_gemma_attention(layer) -> bool:
    """keras-hub's CachedGemmaAttention (heads-first grouped-query attention)."""
    return _hub(layer, "CachedGemmaAttention")


def _accepts(kind: str, layer) -> bool:
    if kind in (COLUMN, ROW, COLUMN_GATHER):
        return is_dense(layer)
    if kind == VOCAB:
        return is_vocab_embedding(layer)
    if kind == HEADS:
        return is_attention(layer)
    if kind == FFN:
        return is_ffn_block(layer)
    return (is_block(layer) or is_ffn_block(layer)) if kind == BLOCK else True


def _has_weights(layer) -> bool:
    """Keras ops in a functional graph (``x[:, 0]``) are operations without weights."""
    return bool(getattr(layer, "weights", None))


def _nbytes(layer) -> int:
    return int(sum(np.prod(w.shape) * np.dtype(w.dtype).itemsize for w in layer.weights))

_ELEMENTWISE_ACTIVATION_LAYERS = (keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.ELU)
_NOT_ELEMENTWISE = {"softmax", "log_softmax"}


@dataclass(frozen=True)
class LayerSplit:
    """How one layer is held: ``kind`` (one of KINDS) and why, when it is not split."""

    name: str
    class_name: str
    kind: str
    params: int
    split_params: int = 0  # of ``params``, those in variables split over the group
    note: str = ""
    partner: str = ""  # the row-split Dense of a column-split one, and the other way round
    nbytes: int = 0  # the layer's weights' bytes, serial


@dataclass
class Plan:
    """The split of every layer with weights, in weights order (nested models opened)."""

    model_name: str
    tensor_parallel_size: int
    layers: list[LayerSplit] = field(default_factory=list)
    #: Dropout layers inside a column -> row chain: each rank applies its slice of the serial mask
    split_dropouts: list[str] = field(default_factory=list)
    #: the model the plan was made of (edits are checked against it); not compared, not shown
    model: keras.Model | None = field(default=None, repr=False, compare=False)

    # -- editing ---------------------------------------------------------------------------
    def _split_of(self, layer_name: str) -> LayerSplit:
        for split in self.layers:
            if split.name == layer_name:
                return split
        raise TensorParallelError(
            f"the plan of {self.model_name!r} has no layer with weights named {layer_name!r}; its layers: "
            f"{', '.join(s.name for s in self.layers)}.")

    def _edit(self, kinds: dict[str, str], notes: dict[str, str]) -> Plan:
        if self.model is None:
            raise TensorParallelError("this plan does not know its model: edit a plan made by "
                                      "tnt.tensor_parallel.plan(model, tensor_parallel_size=t).")
        edited = plan_from_kinds(self.model, self.tensor_parallel_size, kinds, notes)
        self.layers, self.split_dropouts = edited.layers, edited.split_dropouts
        return self

    def replicate(self, *layer_names: str) -> Plan:
        """Keep these layers whole on every rank (a column/row pair is replicated together:
        one half cannot be split without the other). Returns the plan, edited."""
        kinds = self.split_layers()
        notes = {s.name: s.note for s in self.layers}
        for name in layer_names:
            split = self._split_of(name)
            for member in filter(None, (name, split.partner)):
                kinds.pop(member, None)
                notes[member] = "replicated by plan.replicate" + (f" (pair of {name})" if member != name else "")
        return self._edit(kinds, notes)

    def split(self, layers: str | dict[str, str], kind: str | None = None) -> Plan:
        """Split layers as given: ``plan.split("head", "column+allgather")`` or
        ``plan.split({"up": "column", "down": "row"})`` (a pair is given together).
        Checked against the model at once; returns the plan, edited."""
        edits = {layers: kind} if isinstance(layers, str) else dict(layers)
        kinds = self.split_layers()
        notes = {s.name: s.note for s in self.layers}
        for name, new in edits.items():
            self._split_of(name)
            kinds[name] = new
            notes[name] = "set by plan.split"
        return self._edit({n: k for n, k in kinds.items() if k != REPLICATED}, notes)

    def kind(self, layer_name: str) -> str:
        """How ``layer_name`` is held (``replicated`` for a layer without weights)."""
        for split in self.layers:
            if split.name == layer_name:
                return split.kind
        return REPLICATED

    def split_layers(self) -> dict[str, str]:
        """{layer name: kind} of the layers that are split."""
        return {s.name: s.kind for s in self.layers if s.kind != REPLICATED}

    def params_per_rank(self) -> int:
        """Weights one rank holds (split layers' shards plus every replicated weight)."""
        return sum(_local_params(s, self.tensor_parallel_size) for s in self.layers)

    def collectives_per_step(self) -> tuple[int, int]:
        """(forward, backward) collectives of one training step on the tensor group."""
        fwd = sum(COLLECTIVES[s.kind][0] for s in self.layers)
        bwd = sum(COLLECTIVES[s.kind][1] for s in self.layers)
        return fwd, bwd

    def total_bytes(self) -> int:
        """Bytes of every weight of the serial model."""
        return sum(s.nbytes for s in self.layers)

    def replicated_bytes(self) -> int:
        """Bytes of the layers kept whole on every rank (``t > 1``)."""
        return sum(s.nbytes for s in self.layers if s.kind == REPLICATED)

    def replicated_warning(self) -> str:
        """A warning (empty if none) when more than 20 % of the bytes stay replicated at t > 1."""
        total = self.total_bytes()
        if self.tensor_parallel_size == 1 or not total or self.replicated_bytes() <= REPLICATED_WARNING * total:
            return ""
        largest = sorted((s for s in self.layers if s.kind == REPLICATED), key=lambda s: -s.nbytes)[:3]
        named = ", ".join(f"{s.name} ({s.class_name}, {s.nbytes} B" + (f": {s.note})" if s.note else ")")
                          for s in largest)
        return (f"{self.replicated_bytes() / total:.0%} of the weights' bytes of {self.model_name!r} stay "
                f"replicated on every rank (largest: {named}); "
                "see plan.summary() for why, and plan.split(...) to split them.")

    def summary(self, print_fn=print) -> str:
        """A table: per layer its split, weights serial and per rank, and notes."""
        t = self.tensor_parallel_size
        rows = [f"Tensor-parallel plan of {self.model_name!r}, tensor_parallel_size={t}",
                f"{'layer':24} {'class':20} {'split':17} {'params':>10} {'per rank':>10} {'bytes':>10}  note"]
        for s in self.layers:
            rows.append(f"{s.name:24} {s.class_name:20} {s.kind:17} {s.params:>10} "
                        f"{_local_params(s, t):>10} {s.nbytes:>10}  {s.note}")
        for name in self.split_dropouts:
            rows.append(f"{name:24} {'Dropout':20} {'mask slice':17} {0:>10} {0:>10} {0:>10}  "
                        "draws the serial mask, keeps this rank's columns")
        serial = sum(s.params for s in self.layers)
        fwd, bwd = self.collectives_per_step()
        rows.append(f"weights per rank: {self.params_per_rank()} of {serial} "
                    f"({self.params_per_rank() / max(serial, 1):.2f}); collectives per training step: "
                    f"{fwd} forward, at most {bwd} backward (each a blocking call on the group)")
        kept = self.replicated_bytes()
        rows.append(f"replicated (whole on every rank): {kept} of {self.total_bytes()} bytes "
                    f"({kept / max(self.total_bytes(), 1):.2f})")
        warning = self.replicated_warning()
        if warning:
            rows.append(f"WARNING: {warning}")
        text = "\n".join(rows)
        print_fn(text)
        return text


def _local_params(split: LayerSplit, t: int) -> int:
    return split.params - split.split_params * (t - 1) // t


def _params(layer) -> int:
    return int(sum(np.prod(w.shape) for w in layer.weights))


def _split_params(layer, kind: str) -> int:
    axes = SPLIT_AXES[kind]
    return int(sum(np.prod(w.shape) for w in layer.weights if var_name(w, layer) in axes))


def var_name(variable, layer) -> str:
    """The variable's path inside ``layer`` (``kernel``; ``query/kernel`` for attention)."""
    path = variable.path
    prefix = f"{layer.name}/"
    return path[path.rfind(prefix) + len(prefix):] if prefix in path else path.rsplit("/", 1)[-1]


def _attention_refusal(layer, t: int, query_shape: tuple) -> str:
    if layer.num_heads % t:
        return f"num_heads {layer.num_heads} does not divide by t={t}"
    config = layer.get_config()
    if config.get("use_gate") or config.get("sliding_window") is not None:
        return "gated or sliding-window attention is not split"
    if tuple(config.get("attention_axes") or (1,)) != (1,) or len(query_shape) != 2:
        return "only (batch, sequence, features) inputs with the default attention_axes are split"
    return _refusal(layer, t, t)


def _refusal(layer, split_dim: int, t: int) -> str:
    """Why ``layer`` cannot be split (empty: it can)."""
    if split_dim % t:
        return f"split dimension {split_dim} does not divide by t={t}"
    for attr in ("kernel_regularizer", "bias_regularizer", "embeddings_regularizer",
                 "activity_regularizer", "kernel_constraint", "bias_constraint",
                 "embeddings_constraint"):
        if getattr(layer, attr, None) is not None:
            return f"has a {attr.replace('_', ' ')}"
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return "LoRA or quantized layers are not split"
    return ""


def _elementwise(layer) -> bool:
    if isinstance(layer, keras.layers.Dropout) and type(layer) is keras.layers.Dropout:
        return layer.noise_shape is None
    if isinstance(layer, _ELEMENTWISE_ACTIVATION_LAYERS):
        return True
    if isinstance(layer, keras.layers.Activation):
        return getattr(layer.activation, "__name__", "") not in _NOT_ELEMENTWISE
    return False


def _dense_activation_elementwise(layer) -> bool:
    return getattr(layer.activation, "__name__", "") not in _NOT_ELEMENTWISE


def _row_partner(graph: ModelGraph, c: int, uses: dict[int, int]) -> tuple[int | None, list[str]]:
    """The call of the Dense layer a column-split Dense at call ``c`` feeds through
    elementwise layers only (each output consumed once), if any, and the Dropout layers
    on the way."""
    consumers = graph.consumers()
    tensor = graph.calls[c].outputs[0]
    dropouts: list[str] = []
    while True:
        nxt = consumers.get(tensor, [])
        if len(nxt) != 1 or tensor in graph.outputs:
            return None, []
        call = graph.calls[nxt[0]]
        if len(call.inputs) != 1 or len(call.outputs) != 1 or uses[id(call.layer)] != 1:
            return None, []
        if isinstance(call.layer, keras.layers.Dense) or is_dense(call.layer):
            return call.index, dropouts
        if not _elementwise(call.layer):
            return None, []
        if isinstance(call.layer, keras.layers.Dropout):
            dropouts.append(call.layer.name)
        tensor = call.outputs[0]


def check_model(model) -> None:
    """A TensorParallelError naming the fix unless ``model`` is functional or a built Sequential."""
    if not isinstance(model, keras.Model):
        raise TensorParallelError(f"tensor parallelism needs a keras.Model, got {type(model).__name__}.")
    functional = isinstance(model, keras.Sequential) or (
        hasattr(model, "_nodes_by_depth") and getattr(model, "_inputs_struct", None) is not None)
    if not functional:
        raise TensorParallelError(
            f"{type(model).__name__} {model.name!r} is a subclassed model: its call() is Python code "
            "whose layers cannot be replaced by shards. Build it with the functional API "
            "(keras.Model(inputs, outputs)) or keras.Sequential, or train it with "
            "tnt.ParallelStrategy.DATA.")
    if isinstance(model, keras.Sequential) and getattr(model, "_functional", None) is None:
        raise TensorParallelError(
            f"The Sequential model {model.name!r} is not built, so its layers' shapes are unknown. "
            "Start it with keras.Input(shape) (or call model.build(input_shape)) first.")


def check_size(tensor_parallel_size) -> int:
    """``tensor_parallel_size`` as an int >= 1, or a TensorParallelError naming the fix."""
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int | np.integer) \
            or tensor_parallel_size < 1:
        raise TensorParallelError(
            f"tensor_parallel_size must be an integer >= 1 (the ranks sharing one copy of each split "
            f"layer), got {tensor_parallel_size!r}. Pass e.g. tensor_parallel_size=2.")
    return int(tensor_parallel_size)


def _nested(layer) -> bool:
    """A functional (or built Sequential) model used as a layer: its layers are planned too."""
    if not isinstance(layer, keras.Model):
        return False
    if isinstance(layer, keras.Sequential):
        return getattr(layer, "_functional", None) is not None
    return hasattr(layer, "_nodes_by_depth") and getattr(layer, "_inputs_struct", None) is not None


@dataclass
class Flat:
    """A model with its nested functional models opened: every graph, the layers with
    weights in weights order (nested models replaced by their layers), how often each layer
    is called over all graphs, and each layer's first call with its graph."""

    graphs: list[ModelGraph]
    layers: list
    uses: dict[int, int]
    first_call: dict[str, tuple[ModelGraph, object]]
    opened: set[int]  # ids of the nested models whose layers are planned one by one
    whole: dict[int, str]  # ids of nested models kept whole -> why


def flatten(model: keras.Model) -> Flat:
    """``model`` with every nested functional model called once opened (``Flat``)."""
    flat = Flat([], [], {}, {}, set(), {})
    names: dict[str, int] = {}

    def visit(m) -> None:
        graph = model_graph(m)
        flat.graphs.append(graph)
        calls: dict[int, int] = {}
        passing: dict[int, bool] = {}
        for call in graph.calls:
            calls[id(call.layer)] = calls.get(id(call.layer), 0) + 1
            if _nested(call.layer):
                passing[id(call.layer)] = passes_inputs(call.layer, call.node.arguments.args,
                                                        call.node.arguments.kwargs)
            flat.uses[id(call.layer)] = flat.uses.get(id(call.layer), 0) + 1
            flat.first_call.setdefault(call.layer.name, (graph, call))
        for layer in m.layers:
            if _nested(layer) and _has_weights(layer):
                clash = [sub.name for sub in layer.layers if names.get(sub.name, id(sub)) != id(sub)]
                if calls.get(id(layer), 0) == 1 and not clash and passing.get(id(layer)):
                    flat.opened.add(id(layer))
                    visit(layer)
                    continue
                flat.whole[id(layer)] = (
                    f"nested model whose layer names {clash[:3]} are used twice" if clash else
                    f"nested model called {calls.get(id(layer), 0)} times" if calls.get(id(layer), 0) != 1 else
                    "nested model called with other arguments than its inputs") + "; kept whole"
            if _has_weights(layer) and names.setdefault(layer.name, id(layer)) == id(layer) and \
                    all(x is not layer for x in flat.layers):
                flat.layers.append(layer)

    visit(model)
    return flat


def passes_inputs(inner: keras.Model, args: tuple, kwargs: dict) -> bool:
    """Whether a nested model's call passes exactly its inputs, in their own structure (then
    the shard model, built with that structure, takes the same arguments)."""
    if len(args) != 1 or any(v is not None for v in keras.tree.flatten(kwargs)):
        return False  # Keras passes mask=None leaves for a nested model's inputs
    functional = inner._functional if isinstance(inner, keras.Sequential) else inner
    struct = _internals.functional_structure(functional)[0]
    if isinstance(args[0], dict) or isinstance(struct, dict):
        return isinstance(args[0], dict) and isinstance(struct, dict) and sorted(args[0]) == sorted(struct)
    return len(keras.tree.flatten(args[0])) == len(keras.tree.flatten(struct))


def _block_refusal(layer, t: int, input_shape: tuple) -> str:
    """Why a keras-hub Transformer block cannot be split (empty: it can)."""
    if is_ffn_block(layer):
        return _ffn_refusal(layer, t) or _gqa_block_refusal(layer, t)
    if getattr(layer, "_cross_attention_layer", None) is not None:
        return "cross-attention blocks are not split"
    attention = getattr(layer, "_self_attention_layer", None)
    ffn = [getattr(layer, "_feedforward_intermediate_dense", None),
           getattr(layer, "_feedforward_output_dense", None)]
    if attention is None or None in ffn:
        return "not built"
    return (_attention_refusal(attention, t, input_shape) or _refusal(ffn[0], dense_units(ffn[0]), t)
            or _refusal(ffn[1], dense_units(ffn[0]), t))


def _ffn_refusal(layer, t: int) -> str:
    """Why a Llama or Gemma block's gated FFN cannot be split (empty: it can)."""
    parts = block_parts(layer)
    names = (*parts.columns, parts.row)
    dense = [getattr(layer, n, None) for n in names]
    if None in dense or not all(getattr(d, "built", False) for d in dense):
        return "not built"
    for name, d in zip(names, dense):
        if not is_dense(d):
            return f"its feed-forward {name.strip('_')} is not a projection of the last axis"
    return next(filter(None, (_refusal(d, dense_units(dense[0]), t) for d in dense)), "")


def _gqa_block_refusal(layer, t: int) -> str:
    """Why a Llama or Gemma block's grouped-query attention cannot be split by heads (empty: it can)."""
    attention = getattr(layer, block_parts(layer).attention, None)
    if is_gqa_attention(attention):
        return gqa_refusal(attention, t)
    if is_gemma_attention(attention):
        return gemma_refusal(attention, t)
    return "its attention is not keras-hub's LlamaAttention or CachedGemmaAttention"


def _vocab_refusal(layer, t: int, uses: int) -> str:
    """Why an Embedding cannot be split by vocabulary rows (empty: it can). A
    ReversibleEmbedding may be called twice: lookup and (tied) reverse projection."""
    limit = 2 if type(layer) is not keras.layers.Embedding else 1
    if uses > limit:
        return "called more than once"
    return _refusal(layer, layer.input_dim, t)


def plan(model: keras.Model, tensor_parallel_size: int, *,
         min_split_params: int = DEFAULT_MIN_SPLIT_PARAMS) -> Plan:
    """The automatic tensor-parallel plan of a functional or built Sequential model.

    Nested functional models (a keras-hub backbone inside a task model) are planned layer
    by layer. ``min_split_params``: a lone Dense or an Embedding with fewer weights stays
    replicated (a collective per step costs more than it saves); Dense pairs, attention
    layers and Transformer blocks split regardless.
    """
    t = check_size(tensor_parallel_size)
    check_model(model)
    flat = flatten(model)
    uses = flat.uses
    kinds: dict[str, tuple[str, str]] = {}
    for graph in flat.graphs:
        for call in graph.calls:
            layer = call.layer
            if layer.name in kinds or not _has_weights(layer) or id(layer) in flat.opened:
                continue
            if id(layer) in flat.whole:
                kinds[layer.name] = (REPLICATED, flat.whole[id(layer)])
                continue
            if t == 1:
                kinds[layer.name] = (REPLICATED, "t=1")
                continue
            if is_vocab_embedding(layer):
                why = _vocab_refusal(layer, t, uses[id(layer)]) or (
                    f"smaller than min_split_params={min_split_params}" if _params(layer) < min_split_params else "")
                kinds[layer.name] = (REPLICATED, why) if why else (VOCAB, "")
                continue
            if uses[id(layer)] > 1:
                kinds[layer.name] = (REPLICATED, "called more than once")
                continue
            if is_attention(layer):
                why = _attention_refusal(layer, t, graph.tensors[call.inputs[0]].shape)
                kinds[layer.name] = (REPLICATED, why) if why else (HEADS, "")
            elif is_block(layer):
                why = _block_refusal(layer, t, graph.tensors[call.inputs[0]].shape)
                kinds[layer.name] = (REPLICATED, why) if why else (BLOCK, "attention by heads, FFN column/row")
            elif is_ffn_block(layer):
                why = _ffn_refusal(layer, t)
                attention_why = "" if why else _gqa_block_refusal(layer, t)
                if why:
                    kinds[layer.name] = (REPLICATED, why)
                elif attention_why:
                    kinds[layer.name] = (FFN, f"gated FFN column/row; attention whole: {attention_why}")
                    logger.warning("tensor-parallel plan: %s keeps its attention whole on every rank (%s); "
                                   "only its gated FFN is split.", layer.name, attention_why)
                else:
                    kinds[layer.name] = (BLOCK, "attention by query and key/value heads, gated FFN column/row")
            elif is_dense(layer):
                why = _refusal(layer, dense_units(layer), t)
                partner, _ = _row_partner(graph, call.index, uses) \
                    if _dense_activation_elementwise(layer) else (None, [])
                if not why and partner is not None:
                    row = graph.calls[partner].layer
                    row_why = (_refusal(row, dense_units(layer), t) if is_dense(row) else
                               f"a {type(row).__name__} is not a plain Dense")
                    if not row_why:
                        kinds[layer.name] = (COLUMN, f"feeds {row.name}")
                        kinds[row.name] = (ROW, f"fed by {layer.name}")
                        continue
                    why = f"{row.name} cannot be row-split: {row_why}"
                if not why and _params(layer) < min_split_params:
                    why = f"smaller than min_split_params={min_split_params}"
                kinds[layer.name] = (REPLICATED, why) if why else (COLUMN_GATHER, "")
            elif type(layer) is keras.layers.EinsumDense:
                kinds[layer.name] = (REPLICATED, f"EinsumDense {layer.equation!r} is not a projection of the "
                                                 "last axis ('abc,cd->abd')")
            elif type(layer).__name__ == "PositionEmbedding":
                kinds[layer.name] = (REPLICATED, "position table: small, kept whole")
            else:
                kinds[layer.name] = (REPLICATED, f"no split for {type(layer).__name__}")
    return _made(model, t, {n: k for n, (k, _) in kinds.items() if k != REPLICATED},
                 {n: note for n, (_, note) in kinds.items()}, flat)


def _unsupported(name: str, kind: str, why: str) -> TensorParallelError:
    return TensorParallelError(f"layer {name!r} cannot be split as {kind!r}: {why}. {SUPPORTED}.")


def _uses(graph: ModelGraph) -> dict[int, int]:
    uses: dict[int, int] = {}
    for call in graph.calls:
        uses[id(call.layer)] = uses.get(id(call.layer), 0) + 1
    return uses


def _split_refusal(layer, kind: str, t: int, graph: ModelGraph, call, uses: int) -> str:
    """Why ``layer`` cannot be split as ``kind`` (empty: it can)."""
    if kind == VOCAB:
        return _vocab_refusal(layer, t, uses)
    if uses > 1:
        return "it is called more than once"
    if kind in (COLUMN, COLUMN_GATHER):
        return _refusal(layer, dense_units(layer), t)
    if kind == ROW:
        return _refusal(layer, int(layer.kernel.shape[0]), t)
    if kind == BLOCK:
        return _block_refusal(layer, t, graph.tensors[call.inputs[0]].shape)
    if kind == FFN:
        return _ffn_refusal(layer, t)
    return _attention_refusal(layer, t, graph.tensors[call.inputs[0]].shape)


def plan_from_kinds(model: keras.Model, tensor_parallel_size: int, kinds: dict[str, str],
                    notes: dict[str, str] | None = None) -> Plan:
    """The plan splitting each layer named in ``kinds`` ({layer name: kind}) as given and
    replicating the others, or a TensorParallelError naming the layer and ``SUPPORTED``."""
    t = check_size(tensor_parallel_size)
    check_model(model)
    return _made(model, t, kinds, notes, flatten(model))


def _made(model: keras.Model, t: int, kinds: dict[str, str], notes: dict[str, str] | None, flat: Flat) -> Plan:
    notes = dict(notes or {})
    partners: dict[str, str] = {}
    split_dropouts: list[str] = []
    planned = {layer.name for layer in flat.layers}
    for name, kind in kinds.items():
        if kind not in KINDS:
            raise TensorParallelError(f"layer {name!r}: unknown split {kind!r}; the splits are {', '.join(KINDS)}.")
        if name not in planned or name not in flat.first_call:
            raise TensorParallelError(f"model {model.name!r} has no layer with weights named {name!r}.")
        graph, call = flat.first_call[name]
        layer = call.layer
        if kind == REPLICATED:
            continue
        if not _accepts(kind, layer):
            raise _unsupported(name, kind, f"it is a {type(layer).__name__}, a {kind!r} split needs a "
                                           f"{_LAYER_CLASS[kind]}")
        why = _split_refusal(layer, kind, t, graph, call, flat.uses[id(layer)])
        if why:
            raise _unsupported(name, kind, why)
        if kind == COLUMN:
            row, dropouts = _row_partner(graph, call.index, flat.uses) \
                if _dense_activation_elementwise(layer) else (None, [])
            row_name = graph.calls[row].layer.name if row is not None else None
            if row_name is None or kinds.get(row_name) != ROW:
                hint = f" (split {row_name!r} as 'row')" if row_name else ""
                raise _unsupported(name, kind, "its outputs stay split, so it must feed a Dense split as 'row' "
                                               f"through elementwise layers only{hint}; or split it as "
                                               "'column+allgather'")
            partners[name], partners[row_name] = row_name, name
            split_dropouts.extend(dropouts)
    for name, kind in kinds.items():
        if kind == ROW and name not in partners:
            raise _unsupported(name, kind, "its input must come from a Dense split as 'column' through "
                                           "elementwise layers only")
    layers = []
    for layer in flat.layers:
        kind = kinds.get(layer.name, REPLICATED)
        layers.append(LayerSplit(layer.name, type(layer).__name__, kind, _params(layer),
                                 _split_params(layer, kind), notes.get(layer.name, ""),
                                 partners.get(layer.name, ""), _nbytes(layer)))
    return Plan(model.name, t, layers, split_dropouts, model)
