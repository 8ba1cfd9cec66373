"""The shard of a keras-hub Transformer block (``TransformerEncoder``/``TransformerDecoder``,
``LlamaTransformerDecoder``, ``GemmaDecoderBlock``).

A block is a subclassed layer whose ``call`` is Python code: its sub-layers cannot be
replaced in a graph. The shard is an instance of the block's own class (so its ``call``,
residuals, masks and norms are keras-hub's, unchanged) whose attention is the heads shard
and whose feed-forward layers are column/row split, Megatron's block: one SUM-allreduce
after the attention output projection and one after the row-split layer, forward; one
each before the attention and the column-split layers, backward. Every other sub-layer
(norms, dropouts) is the serial block's own object, so its variables and dropout seeds are
the serial ones and are not held twice. Llama's and Gemma's blocks have a gated FFN (both
gating layers column-split, the output layer row-split) and grouped-query attention split
by query and key/value heads (``_gqa``, ``_gemma``). Where each family keeps these layers:
``_families``.
"""

from __future__ import annotations

import keras

from ._collectives import TensorGroup
from ._families import block_parts
from ._gemma import gemma_heads
from ._gqa import gqa_heads
from ._layers import ColumnDense, RowDense, heads_attention
from ._plan import is_gemma_attention, is_gqa_attention


def _fresh(serial: keras.layers.Layer, bare: bool) -> keras.layers.Layer:
    """An unbuilt instance of ``serial``'s class: from its config, or (``bare``, or keras-hub
    0.32's LlamaTransformerDecoder.get_config reads an attribute it never sets) a bare layer
    of that class whose attributes ``block_shard`` copies from ``serial``. Gated blocks are
    bare: Gemma's ``__init__`` makes its norms, which must be the serial objects."""
    try:
        if bare:
            raise AttributeError
        config = serial.get_config()
    except AttributeError:
        shard = type(serial).__new__(type(serial))
        keras.layers.Layer.__init__(shard, name=serial.name, dtype=serial.dtype_policy)
        return shard
    for key in ("decoder_sequence_shape", "encoder_sequence_shape"):  # the decoder would build at once
        config.pop(key, None)
    return type(serial).from_config(config)


def _attention_shard(attention, group: TensorGroup):
    if is_gqa_attention(attention):
        return gqa_heads(attention, group)
    if is_gemma_attention(attention):
        return gemma_heads(attention, group)
    return heads_attention(attention, group)


def block_shard(serial: keras.layers.Layer, group: TensorGroup, attention: bool = True) -> keras.layers.Layer:
    """This rank's shard of the built block ``serial`` (the plan checked it can be split);
    ``attention=False``: only the feed-forward layers split (Llama, Gemma: gating layers
    column, output row), the attention is the serial block's own."""
    parts = block_parts(serial)
    shard = _fresh(serial, bare=parts.gated)
    replaced = {name: ColumnDense(getattr(serial, name), group, gather=False) for name in parts.columns}
    replaced[parts.row] = RowDense(getattr(serial, parts.row), group)
    serial_attention = getattr(serial, parts.attention)
    if attention:
        replaced[parts.attention] = _attention_shard(serial_attention, group)
    # What the serial block's build() made, in its order (its weights' order): the replaced
    # sub-layers as shards (built on the first call, under the block's name scope), the
    # others shared with the serial block.
    for key, value in serial.__dict__.items():
        missing = key not in shard.__dict__ or (shard.__dict__[key] is None and value is not None)
        if key in replaced or (missing and (isinstance(value, keras.layers.Layer) or not key.startswith("_self_"))):
            setattr(shard, key, replaced.get(key, value))  # ("_self_..." are TensorFlow's tracking lists)
    # Built now, under the block's name scope (so variable paths are the serial ones): a
    # block with its own compute_output_shape is never traced symbolically.
    first = getattr(serial, parts.columns[0])
    width = int(first.kernel.shape[0])
    with keras.name_scope(serial.name):
        if attention and (is_gqa_attention(serial_attention) or is_gemma_attention(serial_attention)):
            replaced[parts.attention].build((None, None, width))
        elif attention:
            widths = [int(getattr(serial_attention, p).kernel.shape[0])
                      for p in ("_query_dense", "_value_dense", "_key_dense")]
            replaced[parts.attention].build((None, None, widths[0]), (None, None, widths[1]),
                                            (None, None, widths[2]))
        for name in parts.columns:
            replaced[name].build((None, width))
        replaced[parts.row].build((None, int(first.kernel.shape[1]) // group.size))
    shard.built = True
    return shard


__all__ = ["block_shard"]
