"""The shard layers a rank builds in place of a split Keras layer.

Each holds only its rank's slice of the serial layer's variables and computes what the
serial layer computes, with the group collectives of ``_collectives`` where the shards'
results meet. They are never saved: ``get_weights`` of a tensor-parallel model gathers the
serial-shaped weights instead. The arithmetic mirrors Keras' own ``Dense``/``Embedding``
call (matmul, add bias, activation; take), so only the summation order of a row split
differs from serial. Variables start at zero (no random draw): the model assigns every
shard its slice of the serial weights right after building.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from .._core import internals as _internals
from ._collectives import TensorGroup, copy_to_group, gather_last_axis, reduce_from_group


class _DenseShard(keras.layers.Layer):
    """What both Dense shards hold: ``units`` outputs of a (possibly split) kernel and
    the serial layer's bias and activation. The serial layer is a Dense or an EinsumDense
    projecting the last axis (``"abc,cd->abd"``: the same matmul, kernel and bias)."""

    def __init__(self, serial: keras.layers.Layer, group: TensorGroup, units: int) -> None:
        super().__init__(name=serial.name, dtype=serial.dtype_policy)
        self.group = group
        self.units = units
        self.use_bias = serial.bias is not None  # Dense, or an EinsumDense "abc,cd->abd" (bias "d")
        self.activation = serial.activation

    def build(self, input_shape) -> None:
        """Create this rank's kernel (and bias) shard, zero until the model assigns it."""
        self.kernel = self.add_weight(name="kernel", shape=(input_shape[-1], self.units),
                                      initializer="zeros")
        self.bias = self.add_weight(name="bias", shape=(self.units,),
                                    initializer="zeros") if self.use_bias else None

    def _finish(self, x):
        """Bias and activation, as Keras' Dense applies them."""
        if self.bias is not None:
            x = ops.add(x, self.bias)
        return self.activation(x) if self.activation is not None else x


class ColumnDense(_DenseShard):
    """Output columns ``[rank*w, (rank+1)*w)`` of a Dense layer (kernel ``[:, cols]``,
    bias ``[cols]``). With ``gather`` the group's columns are joined (allgather) before
    the activation, so the output is the serial one; without, the output stays split and
    a row-split layer must follow (through elementwise layers only)."""

    def __init__(self, serial: keras.layers.Layer, group: TensorGroup, gather: bool) -> None:
        full_units = int(serial.kernel.shape[1])
        super().__init__(serial, group, full_units // group.size)
        self.gather = gather
        self.full_units = full_units

    def call(self, inputs):
        """f, this rank's columns, then (with ``gather``) the allgather and the activation."""
        x = ops.matmul(copy_to_group(inputs, self.group), self.kernel)
        if not self.gather:
            return self._finish(x)
        if self.bias is not None:
            x = ops.add(x, self.bias)
        x = gather_last_axis(x, self.group)
        return self.activation(x) if self.activation is not None else x

    def compute_output_shape(self, input_shape):
        """The serial output shape with ``gather``; this rank's columns without."""
        return (*input_shape[:-1], self.full_units if self.gather else self.units)


class RowDense(_DenseShard):
    """A Dense layer fed with its input's column slice ``rank``: kernel rows of that
    slice; partial products SUM-allreduced, then the (replicated) bias and activation."""

    def __init__(self, serial: keras.layers.Layer, group: TensorGroup) -> None:
        super().__init__(serial, group, int(serial.kernel.shape[1]))

    def call(self, inputs):
        """This rank's partial product, SUM over the group (g), bias, activation."""
        return self._finish(reduce_from_group(ops.matmul(inputs, self.kernel), self.group))

    def compute_output_shape(self, input_shape):
        """The serial Dense layer's output shape."""
        return (*input_shape[:-1], self.units)


class VocabEmbedding(keras.layers.Layer):
    """Rows ``[rank*v, (rank+1)*v)`` of an Embedding table: ids outside them look up
    zeros, and the group's SUM gives every id its one row (exact: one term is non-zero)."""

    def __init__(self, serial: keras.layers.Embedding, group: TensorGroup) -> None:
        super().__init__(name=serial.name, dtype=serial.dtype_policy)
        self.group = group
        self.rows = serial.input_dim // group.size
        self.start = group.rank * self.rows
        self.output_dim = serial.output_dim
        self.mask_zero = serial.mask_zero
        self.supports_masking = self.mask_zero

    def build(self, input_shape=None) -> None:
        """Create this rank's rows of the table, zero until the model assigns them."""
        self.embeddings = self.add_weight(name="embeddings", shape=(self.rows, self.output_dim),
                                          initializer="zeros")

    def call(self, inputs):
        """Masked lookup of this rank's rows, SUM over the group (g)."""
        if inputs.dtype not in ("int32", "int64"):
            inputs = ops.cast(inputs, "int32")
        local = inputs - ops.cast(self.start, inputs.dtype)
        inside = ops.logical_and(local >= 0, local < self.rows)
        rows = ops.take(self.embeddings, ops.where(inside, local, ops.zeros_like(local)), axis=0)
        rows = rows * ops.expand_dims(ops.cast(inside, rows.dtype), -1)
        return reduce_from_group(rows, self.group)

    def compute_mask(self, inputs, mask=None):
        """Keras' Embedding mask (``mask_zero``), computed from the whole ids."""
        return ops.not_equal(inputs, 0) if self.mask_zero else None

    def compute_output_shape(self, input_shape):
        """The serial Embedding's output shape."""
        return (*input_shape, self.output_dim)



class SliceDropout(keras.layers.Layer):
    """A Dropout layer on split activations (between a column- and a row-split Dense:
    ``axis=-1``; on attention scores split by heads: ``axis=1``): it draws the serial
    layer's whole mask (same seed generator, so the same draws as serial Keras) and keeps
    this rank's slice along ``axis``, so training with dropout equals serial too."""

    def __init__(self, serial: keras.layers.Dropout, group: TensorGroup, axis: int = -1) -> None:
        super().__init__(name=serial.name, dtype=serial.dtype_policy)
        self.group = group
        self.rate = serial.rate
        self.axis = axis
        object.__setattr__(self, "_serial", serial)  # its seed generator; not tracked twice

    def call(self, inputs, training=False):
        """``inputs`` times this rank's slice of the serial mask (training only)."""
        if not training or self.rate <= 0:
            return inputs
        axis = self.axis % inputs.shape.rank
        width = inputs.shape[axis]
        shape = tf.shape(inputs)
        whole = tf.concat([shape[:axis], [width * self.group.size], shape[axis + 1:]], axis=0)
        mask = keras.random.dropout(tf.ones(whole, dtype=inputs.dtype), self.rate,
                                    seed=self._serial.seed_generator)
        begin = [0] * inputs.shape.rank
        begin[axis] = self.group.rank * width
        return inputs * tf.slice(mask, begin, shape)

    def compute_output_shape(self, input_shape):
        """Unchanged."""
        return input_shape


def _copy_keeping_mask(x, group: TensorGroup):
    """f on ``x``, carrying its Keras mask over (attention reads the inputs' masks)."""
    mask = _internals.get_keras_mask(x)
    y = copy_to_group(x, group)
    if mask is not None:
        _internals.set_keras_mask(y, mask)
    return y


class _RowEinsumDense(keras.layers.EinsumDense):
    """An attention output projection fed with this rank's heads: the partial products
    are SUM-allreduced, then the (replicated) bias is added."""

    def __init__(self, group: TensorGroup, **config) -> None:
        super().__init__(**config)
        self.group = group

    def call(self, inputs, training=None):
        """This rank's heads' partial projection, SUM over the group (g), bias."""
        x = reduce_from_group(ops.einsum(self.equation, inputs, self.kernel), self.group)
        if self.bias is not None:
            x = ops.add(x, self.bias)
        return self.activation(x) if self.activation is not None else x


class _Heads:
    """Heads ``[rank*h, (rank+1)*h)`` of a MultiHeadAttention layer (or a subclass with the
    same projections, keras-hub's CachedMultiHeadAttention): Q/K/V projections of those
    heads, attention per head (dropout: the slice of the serial mask), the output
    projection's rows of those heads, SUM-allreduced, then the bias."""

    def __init__(self, serial: keras.layers.MultiHeadAttention, group: TensorGroup) -> None:
        config = serial.get_config()
        config.update(num_heads=serial.num_heads // group.size, kernel_initializer="zeros",
                      bias_initializer="zeros")
        super().__init__(**config)
        self.group = group
        object.__setattr__(self, "_tnt_serial", serial)  # its attention dropout's seed generator

    def _make_output_dense(self, query_shape, common_kwargs, name=None):
        dense = super()._make_output_dense(query_shape, common_kwargs, name)
        return _RowEinsumDense(self.group, **dense.get_config())

    def _build_attention(self, rank):
        super()._build_attention(rank)
        if self._dropout > 0:
            self._dropout_layer = SliceDropout(self._tnt_serial._dropout_layer, self.group, axis=1)

    def call(self, query, value, key=None, training=None, **kwargs):
        """The serial class's attention on this rank's heads; the inputs pass through f first."""
        q = _copy_keeping_mask(query, self.group)
        v = q if value is query else _copy_keeping_mask(value, self.group)
        k = None if key is None else q if key is query else v if key is value else \
            _copy_keeping_mask(key, self.group)
        return super().call(q, v, key=k, training=training, **kwargs)


class HeadsAttention(_Heads, keras.layers.MultiHeadAttention):
    __doc__ = _Heads.__doc__


_HEADS_CLASSES: dict[type, type] = {keras.layers.MultiHeadAttention: HeadsAttention}


def heads_attention(serial: keras.layers.MultiHeadAttention, group: TensorGroup) -> keras.layers.Layer:
    """The heads shard of ``serial``, of a subclass of ``serial``'s own class (its call)."""
    cls = type(serial)
    if cls not in _HEADS_CLASSES:
        _HEADS_CLASSES[cls] = type(f"Heads{cls.__name__}", (_Heads, cls), {"__doc__": _Heads.__doc__})
    return _HEADS_CLASSES[cls](serial, group)


class VocabReversibleEmbedding(VocabEmbedding):
    """A ReversibleEmbedding's vocabulary rows ``[rank*v, (rank+1)*v)``: the lookup as
    ``VocabEmbedding``; the reverse projection (``reverse=True``: hidden states to logits)
    computes this rank's vocabulary columns (its rows of the tied table, transposed, or its
    columns of ``reverse_embeddings``) and joins the group's columns by an allgather."""

    def __init__(self, serial, group: TensorGroup) -> None:
        super().__init__(serial, group)
        self.tie_weights = serial.tie_weights
        self.reverse_dtype = serial.reverse_dtype
        self.logit_soft_cap = serial.logit_soft_cap

    def build(self, input_shape=None) -> None:
        """This rank's rows of the table (and columns of an untied reverse table), zero."""
        super().build(input_shape)
        if not self.tie_weights:
            self.reverse_embeddings = self.add_weight(name="reverse_embeddings",
                                                      shape=(self.output_dim, self.rows), initializer="zeros")

    def call(self, inputs, reverse=False):
        """The lookup, or the reverse projection onto the whole vocabulary (allgathered)."""
        if not reverse:
            out = super().call(inputs)
            if self.mask_zero:  # as ReversibleEmbedding: the mask is set in call
                _internals.set_keras_mask(out, ops.not_equal(inputs, 0))
            return out
        kernel = ops.transpose(self.embeddings) if self.tie_weights else self.reverse_embeddings
        inputs = copy_to_group(inputs, self.group)
        if self.reverse_dtype is not None:
            inputs, kernel = ops.cast(inputs, self.reverse_dtype), ops.cast(kernel, self.reverse_dtype)
        logits = gather_last_axis(ops.matmul(inputs, kernel), self.group)
        if self.logit_soft_cap is not None:
            soft_cap = self.logit_soft_cap
            logits = ops.multiply(ops.tanh(ops.divide(logits, soft_cap)), soft_cap)
        return logits

    def compute_mask(self, inputs, mask=None):
        """ReversibleEmbedding's: no mask."""
        return None

    def compute_output_shape(self, input_shape, reverse=False):
        """The serial layer's output shape (logits over the whole vocabulary when reversed)."""
        if reverse:
            return (*input_shape[:-1], self.rows * self.group.size)
        return (*input_shape, self.output_dim)

    def compute_output_spec(self, inputs, reverse=False):
        """As ReversibleEmbedding's (two call arguments, one output)."""
        return keras.KerasTensor(self.compute_output_shape(inputs.shape, reverse), dtype=self.compute_dtype)
