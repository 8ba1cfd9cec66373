"""The heads shard of keras-hub's ``CachedGemmaAttention`` (Gemma's grouped-query attention).

Gemma's projections are heads-first: ``btd,ndh->btnh`` (query, ``n`` query heads) and
``bsd,kdh->bskh`` (key, value: ``k`` key/value heads), output ``btnh,nhd->btd``. A rank holds
query heads ``[r*u/t, (r+1)*u/t)`` and key/value heads ``[r*v/t, (r+1)*v/t)`` (kernel axis 0
of all four). keras-hub groups the query heads as ``(k, u/v)`` (query head ``j`` reads
key/value head ``j // (u/v)``), so a rank's query heads read exactly its key/value heads.
The rotary embedding, the logit soft cap, the sliding-window mask and the softmax act per
head; the output projection takes the rank's heads' rows and SUM-allreduces the partial
products. The query scale is ``1/sqrt(head_dim)``, or with ``query_head_dim_normalize=False``
``1/sqrt(hidden_dim // num_query_heads)``: the shard keeps the serial quotient by holding
``hidden_dim`` scaled with its share of the query heads (the output projection, built here,
still returns the whole hidden size).

The shard's class is a subclass of the serial layer's own: its ``call`` is keras-hub's.
"""

from __future__ import annotations

import inspect

import keras

from ._collectives import TensorGroup, copy_to_group
from ._gqa import gqa_refusal
from ._layers import SliceDropout, _RowEinsumDense

#: Gemma's projections (t/s query/key positions, d model, n/k query/key-value heads, h head size)
EQUATIONS = {"query_dense": "btd,ndh->btnh", "key_dense": "bsd,kdh->bskh", "value_dense": "bsd,kdh->bskh",
             "output_dense": "btnh,nhd->btd"}


def gemma_refusal(attention, t: int) -> str:
    """Why a CachedGemmaAttention cannot be split by heads over ``t`` ranks (empty: it can)."""
    return gqa_refusal(attention, t, EQUATIONS)


class _GemmaHeads:
    """This rank's heads of a keras-hub CachedGemmaAttention (see the module doc)."""

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
        """The serial projections' configs with this rank's head counts; the rotary
        embedding and softmax (no weights) are the serial layer's own objects."""
        serial = self._tnt_serial
        # hidden_dim // num_query_heads stays the serial quotient (the query scale)
        self.hidden_dim = serial.hidden_dim // serial.num_query_heads * self.num_query_heads

        def projection(attr: str, heads: int) -> keras.layers.EinsumDense:
            config = getattr(serial, attr).get_config()
            config.update(output_shape=(None, heads, self.head_dim), kernel_initializer="zeros")
            dense = keras.layers.EinsumDense.from_config(config)
            dense.build(inputs_shape)
            return dense

        self.query_dense = projection("query_dense", self.num_query_heads)
        self.key_dense = projection("key_dense", self.num_key_value_heads)
        self.value_dense = projection("value_dense", self.num_key_value_heads)
        # on the scores (b, k, g, t, s): this rank's key/value heads of the serial mask
        self.dropout_layer = SliceDropout(serial.dropout_layer, self.group, axis=1) \
            if serial.dropout > 0 else serial.dropout_layer
        config = serial.output_dense.get_config()
        config.update(kernel_initializer="zeros")
        self.output_dense = _RowEinsumDense(self.group, **config)
        self.output_dense.build((None, None, self.num_query_heads, self.head_dim))
        self.softmax = serial.softmax
        self.rope_layer = serial.rope_layer
        self.built = True

    def call(self, x, attention_mask=None, cache=None, cache_update_index=0, training=False):
        """keras-hub's call on this rank's heads; the hidden states pass through f first."""
        return super().call(copy_to_group(x, self.group), attention_mask=attention_mask, cache=cache,
                            cache_update_index=cache_update_index, training=training)


_CLASSES: dict[type, type] = {}


def gemma_heads(serial: keras.layers.Layer, group: TensorGroup) -> keras.layers.Layer:
    """The unbuilt heads shard of the built keras-hub CachedGemmaAttention ``serial``."""
    cls = type(serial)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Heads{cls.__name__}", (_GemmaHeads, cls), {"__doc__": _GemmaHeads.__doc__})
    return _CLASSES[cls](serial, group)


__all__ = ["EQUATIONS", "gemma_heads", "gemma_refusal"]
