"""Sparse gradients (``tf.IndexedSlices``) combined over ranks as serial Keras sees them.

An ``Embedding`` lookup's gradient is a ``tf.IndexedSlices``: one row of values per token
looked up, with the token's id as index. Serial Keras (TensorFlow backend) hands it to the
optimizer as it is, and the optimizer's arithmetic on it is not that of the dense sum:
Adam's second moment gets ``sum_i v_i**2`` for a row looked up several times, not
``(sum_i v_i)**2``; ``global_clipnorm`` sums the squares of the slices. So densifying
(summing the ranks' dense gradients) changes the result of every model with an Embedding
under Adam, even on one rank.

tnt therefore keeps the slices (Note [Sparse gradients as serial]): the global gradient of
a sparse variable is the concatenation, in rank order, of every rank's slices, each rank's
values weighted as its dense gradients are. With a contiguous split of the global batch
(tnt_data's rule) rank order is serial order, so the optimizer receives the same indices in
the same order with the same values as serial Keras on the global batch; in pipelining the
micro-batches' slices are concatenated in micro-batch order for the same reason.

``sparse_as_dense=True`` (``TNT_SPARSE_AS_DENSE=1``) is the explicit opposite, as Horovod
offers it: gradients are densified before the exchange and summed in the fused allreduce.
It trades exactness (for Adam-like optimizers) for one fixed-size allreduce instead of an
allgather whose size grows with the tokens per batch (docs/keras.md, "Sparse gradients").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

# Note [Sparse gradients as serial]
# The exchange of a step's sparse gradients runs after its fused allreduce has returned
# (the gathers take the reduced batch size as a control input): the engine's buckets and
# a blocking allgather on the same ranks must be issued in the same order on every rank,
# and backprop may finish the sparse gradients before or after the last bucket. One
# allgather of the indices and one of the values per sparse variable, in variable order.


def is_sparse(grad) -> bool:
    return isinstance(grad, tf.IndexedSlices)


def scale(grad, factor):
    """``grad * factor`` for a dense or a sparse gradient (a sparse one stays sparse)."""
    if is_sparse(grad):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def divide(grad, divisor):
    """``grad / divisor`` for a dense or a sparse gradient (a sparse one stays sparse)."""
    if is_sparse(grad):
        return tf.IndexedSlices(grad.values / tf.cast(divisor, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad / tf.cast(divisor, grad.dtype)


def keep_rows_if(grad: tf.IndexedSlices, keep: tf.Tensor) -> tf.IndexedSlices:
    """``grad``, or no slices at all where ``keep`` is false (a rank without data, whose
    stand-in sample's slices serial Keras never sees)."""
    rows = tf.where(keep, tf.shape(grad.indices)[0], 0)
    return tf.IndexedSlices(grad.values[:rows], grad.indices[:rows], grad.dense_shape)


def no_slices(variable, index_dtype: tf.DType = tf.int64) -> tf.IndexedSlices:
    """A sparse gradient of ``variable`` holding no slices (a part without samples)."""
    shape = tuple(int(d) for d in variable.shape)
    return tf.IndexedSlices(tf.zeros((0, *shape[1:]), variable.dtype), tf.zeros((0,), index_dtype),
                            tf.constant(shape, tf.int64))


def concat(parts: Sequence[tf.IndexedSlices]) -> tf.IndexedSlices:
    """The slices of ``parts`` one after another (the gradient of the sum of their losses)."""
    if len(parts) == 1:
        return parts[0]
    return tf.IndexedSlices(tf.concat([p.values for p in parts], 0),
                            tf.concat([p.indices for p in parts], 0), parts[0].dense_shape)


def accumulate(total, grad):
    """``total + grad`` for gradients of one variable: slices are concatenated (in call
    order), dense gradients added; a mix (never produced by one variable in practice) is
    added densely."""
    if total is None:
        return grad
    if is_sparse(total) and is_sparse(grad):
        return concat([total, grad])
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(grad)


def to_dense(grad):
    """``sparse_as_dense``: the dense sum of the slices (what an allreduce would combine)."""
    return tf.convert_to_tensor(grad) if is_sparse(grad) else grad


def squared_sum(grad) -> tf.Tensor:
    """``sum(g**2)`` as Keras' ``global_norm`` computes it: over the slices' values for a
    sparse gradient (a repeated row counts once per slice), in float32."""
    values = grad.values if is_sparse(grad) else grad
    return tf.reduce_sum(tf.square(tf.cast(values, tf.float32)))


def all_finite(grad, as_float16: bool = False) -> tf.Tensor:
    values = grad.values if is_sparse(grad) else tf.convert_to_tensor(grad)
    if as_float16:
        values = tf.cast(values, tf.float16)
    return tf.reduce_all(tf.math.is_finite(values))


def allgather(grad: tf.IndexedSlices, comm=None, after: Sequence[tf.Tensor] = ()) -> tf.IndexedSlices:
    """Every rank's slices of ``grad``, concatenated in rank order, over ``comm`` (default:
    the whole job); in a graph, after the tensors ``after`` exist (Note [Sparse gradients as
    serial])."""
    import tnt_comm

    gather = tnt_comm.allgather if comm is None else comm.allgather

    def exchange(indices: np.ndarray, values: np.ndarray, *_after) -> list[np.ndarray]:
        return [gather(np.ascontiguousarray(indices)), gather(np.ascontiguousarray(values))]

    indices, values = tf.numpy_function(
        exchange, [grad.indices, grad.values, *after], [grad.indices.dtype, grad.values.dtype],
        stateful=True, name="tnt_allgather_slices")
    indices.set_shape([None])
    values.set_shape(tf.TensorShape([None]).concatenate(grad.values.shape[1:]))
    return tf.IndexedSlices(values, indices, grad.dense_shape)


def allgather_eager(grad: tf.IndexedSlices, gather) -> tf.IndexedSlices:
    """:func:`allgather` outside a graph, through ``gather`` (an array allgather in rank
    order, e.g. a pipeline stage's replica group)."""
    indices = gather(np.ascontiguousarray(np.asarray(grad.indices)))
    values = gather(np.ascontiguousarray(np.asarray(grad.values)))
    return tf.IndexedSlices(tf.convert_to_tensor(values), tf.convert_to_tensor(indices),
                            grad.dense_shape)
