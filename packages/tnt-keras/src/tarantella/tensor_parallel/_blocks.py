"""The shard of a keras-hub Transformer block (``TransformerEncoder``/``TransformerDecoder``,
``LlamaTransformerDecoder``).

A block is a subclassed layer whose ``call`` is Python code: its sub-layers cannot be
replaced in a graph. The shard is a fresh instance of the block's own class (so its
``call``, residuals, masks and layer norms are keras-hub's, unchanged) whose attention is
the heads shard and whose feed-forward pair is column/row split, Megatron's block: one
SUM-allreduce after the attention output projection and one after the second Dense,
forward; one each before the attention and the first Dense, backward. Every other
sub-layer (layer norms, dropouts) is the serial block's own object, so its variables and
dropout seeds are the serial ones and are not held twice. Llama's block has a gated FFN
(gate and intermediate Dense column-split, output Dense row-split) and grouped-query
attention with rotary embeddings, split by query and key/value heads (``_gqa``).
"""

from __future__ import annotations

import keras

from ._collectives import TensorGroup
from ._gqa import gqa_heads
from ._layers import ColumnDense, RowDense, heads_attention
from ._plan import is_gqa_attention

#: sub-layer attributes of keras-hub's blocks that the shard replaces
_ATTENTION = "_self_attention_layer"
_FFN_IN = "_feedforward_intermediate_dense"
_FFN_OUT = "_feedforward_output_dense"
_FFN_GATE = "_feedforward_gate_dense"  # Llama's gated FFN: gate and intermediate both column-split


def _fresh(serial: keras.layers.Layer) -> keras.layers.Layer:
    """An unbuilt instance of ``serial``'s class: from its config, or (keras-hub 0.32's
    LlamaTransformerDecoder.get_config reads an attribute it never sets) a bare layer of
    that class whose attributes ``block_shard`` copies from ``serial``."""
    try:
        config = serial.get_config()
    except AttributeError:
        shard = type(serial).__new__(type(serial))
        keras.layers.Layer.__init__(shard, name=serial.name, dtype=serial.dtype_policy)
        return shard
    for key in ("decoder_sequence_shape", "encoder_sequence_shape"):  # the decoder would build at once
        config.pop(key, None)
    return type(serial).from_config(config)


def block_shard(serial: keras.layers.Layer, group: TensorGroup, attention: bool = True) -> keras.layers.Layer:
    """This rank's shard of the built block ``serial`` (the plan checked it can be split);
    ``attention=False``: only the feed-forward layers split (Llama: gate and intermediate
    column, output row), the attention is the serial block's own."""
    shard = _fresh(serial)
    replaced = {
        _FFN_IN: ColumnDense(getattr(serial, _FFN_IN), group, gather=False),
        _FFN_OUT: RowDense(getattr(serial, _FFN_OUT), group),
    }
    if getattr(serial, _FFN_GATE, None) is not None:
        replaced[_FFN_GATE] = ColumnDense(getattr(serial, _FFN_GATE), group, gather=False)
    serial_attention = getattr(serial, _ATTENTION)
    gqa = is_gqa_attention(serial_attention)
    if attention:
        replaced[_ATTENTION] = (gqa_heads if gqa else heads_attention)(serial_attention, group)
    # What the serial block's build() made, in its order (its weights' order): the replaced
    # sub-layers as shards (built on the first call, under the block's name scope), the
    # others shared with the serial block.
    for key, value in serial.__dict__.items():
        missing = key not in shard.__dict__ or (shard.__dict__[key] is None and value is not None)
        if key in replaced or (missing and (isinstance(value, keras.layers.Layer) or not key.startswith("_self_"))):
            setattr(shard, key, replaced.get(key, value))  # ("_self_..." are TensorFlow's tracking lists)
    # Built now, under the block's name scope (so variable paths are the serial ones): a
    # block with its own compute_output_shape is never traced symbolically.
    ffn_in = getattr(serial, _FFN_IN)
    with keras.name_scope(serial.name):
        if attention and gqa:
            replaced[_ATTENTION].build((None, None, int(serial_attention._query_dense.kernel.shape[0])))
        elif attention:
            width = [int(getattr(serial_attention, p).kernel.shape[0])
                     for p in ("_query_dense", "_value_dense", "_key_dense")]
            replaced[_ATTENTION].build((None, None, width[0]), (None, None, width[1]), (None, None, width[2]))
        replaced[_FFN_IN].build((None, int(ffn_in.kernel.shape[0])))
        if _FFN_GATE in replaced:
            replaced[_FFN_GATE].build((None, int(ffn_in.kernel.shape[0])))
        replaced[_FFN_OUT].build((None, ffn_in.units // group.size))
    shard.built = True
    return shard


__all__ = ["block_shard"]
