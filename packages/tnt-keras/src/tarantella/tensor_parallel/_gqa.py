"""The heads shard of keras-hub's ``LlamaAttention`` (grouped-query attention, rotary embeddings).

A rank holds query heads ``[r*u/t, (r+1)*u/t)`` and key/value heads ``[r*v/t, (r+1)*v/t)``
(``u``/``v`` query and key/value heads, both divisible by ``t``). keras-hub repeats each
key/value head ``u/v`` times (``ops.repeat``: query head ``j`` reads key/value head
``j // (u/v)``), so the query heads of a rank read exactly its own key/value heads: the
shard's ``u/t`` and ``v/t`` keep the serial grouping ``u/v``. The rotary embedding turns
every head by its sequence position along the head dimension only (sequence axis 1,
feature axis -1), so it is the same on any subset of heads; the softmax is per head, the
mask broadcast over heads. The output projection ``bquh,uhm->bqm`` takes its rows of the
rank's heads and SUM-allreduces the partial products (as the MultiHeadAttention shard).

The shard is an instance of a subclass of the serial layer's own class: its ``call``
(RoPE, the cache paths, the mask, the softmax in float32) is keras-hub's, unchanged; only
``build`` makes the projections with the shard's head counts and the serial head size.
A cache passed to its call (cached generation) must hold this rank's key/value heads;
training and ``predict`` of the functional graph pass none.
"""

from __future__ import annotations

import inspect

import keras

from ._collectives import TensorGroup, copy_to_group
from ._layers import SliceDropout, _RowEinsumDense

#: keras-hub's projections (b batch, q/k lengths, m model, u/v query/key-value heads, h head size)
EQUATIONS = {"_query_dense": "bqm,muh->bquh", "_key_dense": "bkm,mvh->bkvh", "_value_dense": "bkm,mvh->bkvh",
             "_output_dense": "bquh,uhm->bqm"}


def gqa_refusal(attention, t: int, equations: dict[str, str] = EQUATIONS) -> str:
    """Why a keras-hub grouped-query attention (LlamaAttention; Gemma's with its own
    ``equations``: {projection attribute: einsum}) cannot be split by heads over ``t``
    ranks (empty: it can)."""
    if not getattr(attention, "built", False):
        return "not built"
    u, v = attention.num_query_heads, attention.num_key_value_heads
    if u % t or v % t:
        return (f"num_query_heads {u} and num_key_value_heads {v} must both divide by t={t} "
                "(a rank holds u/t query and v/t key/value heads)")
    for attr, equation in equations.items():
        dense = getattr(attention, attr, None)
        if getattr(dense, "equation", None) != equation:
            return f"its {attr.strip('_')} projection is not {equation!r} (another keras-hub version)"
        if getattr(dense, "bias", None) is not None:
            return f"its {attr.strip('_')} projection has a bias"
        for name in ("kernel_regularizer", "bias_regularizer", "kernel_constraint", "bias_constraint"):
            if getattr(dense, name, None) is not None:
                return f"its {attr.strip('_')} projection has a {name.replace('_', ' ')}"
        if getattr(dense, "lora_enabled", False) or getattr(dense, "quantization_mode", None):
            return "LoRA or quantized layers are not split"
    return ""


class _GQAHeads:
    """This rank's heads of a keras-hub LlamaAttention (see the module doc)."""

    def __init__(self, serial: keras.layers.Layer, group: TensorGroup) -> None:
        t = group.size
        params = inspect.signature(type(serial).__init__).parameters
        config = {p: getattr(serial, p) for p in params if p not in ("self", "kwargs") and hasattr(serial, p)}
        config.update(num_query_heads=serial.num_query_heads // t, num_key_value_heads=serial.num_key_value_heads // t,
                      kernel_initializer="zeros")
        super().__init__(**config, dtype=serial.dtype_policy, name=serial.name)
        self.group = group
        object.__setattr__(self, "_tnt_serial", serial)  # not tracked: its sub-layers are copied below

    def build(self, inputs_shape) -> None:
        """The serial projections' configs with this rank's head counts (the serial head size);
        the rotary embedding and softmax (no weights) are the serial layer's own objects."""
        serial = self._tnt_serial
        head_dim = int(serial._query_dense.kernel.shape[-1])
        self._inv_norm_factor = serial._inv_norm_factor

        def projection(attr: str, heads: int) -> keras.layers.EinsumDense:
            config = getattr(serial, attr).get_config()
            config.update(output_shape=(None, heads, head_dim), kernel_initializer="zeros", bias_initializer="zeros")
            dense = keras.layers.EinsumDense.from_config(config)
            dense.build(inputs_shape)
            return dense

        self._query_dense = projection("_query_dense", self.num_query_heads)
        self._key_dense = projection("_key_dense", self.num_key_value_heads)
        self._value_dense = projection("_value_dense", self.num_key_value_heads)
        self._softmax = serial._softmax
        # on the combined heads (b, q, u, h): this rank's heads of the serial mask
        self._dropout_layer = SliceDropout(serial._dropout_layer, self.group, axis=2) \
            if serial.dropout > 0 else serial._dropout_layer
        config = serial._output_dense.get_config()
        config.update(kernel_initializer="zeros", bias_initializer="zeros")
        self._output_dense = _RowEinsumDense(self.group, **config)
        self._output_dense.build((None, None, self.num_query_heads, head_dim))
        self.rotary_embedding_layer = serial.rotary_embedding_layer
        self._dot_product_equation = serial._dot_product_equation
        self._combine_equation = serial._combine_equation
        self.built = True

    def call(self, hidden_states, attention_mask=None, cache=None, cache_update_index=None, training=None):
        """keras-hub's call on this rank's heads; the hidden states pass through f first."""
        return super().call(copy_to_group(hidden_states, self.group), attention_mask=attention_mask, cache=cache,
                            cache_update_index=cache_update_index, training=training)


_CLASSES: dict[type, type] = {}


def gqa_heads(serial: keras.layers.Layer, group: TensorGroup) -> keras.layers.Layer:
    """The unbuilt heads shard of the built keras-hub LlamaAttention ``serial``."""
    cls = type(serial)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Heads{cls.__name__}", (_GQAHeads, cls), {"__doc__": _GQAHeads.__doc__})
    return _CLASSES[cls](serial, group)


__all__ = ["EQUATIONS", "gqa_heads", "gqa_refusal"]
