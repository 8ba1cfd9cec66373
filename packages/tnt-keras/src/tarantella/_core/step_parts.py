"""Pieces of a distributed step that every step builder shares (the default steps of
``_steps``, a user's own steps in ``_custom_steps``, the variable build of ``_sync``):
what a batch element holds, padding an empty micro-batch, gathering outputs in rank order.
"""

from __future__ import annotations

import keras
import tensorflow as tf

import tnt_data


def split_sizes(data):
    """``(batch, StepSizes)`` from tnt_data (``with_sizes=True``), else ``(batch, None)``."""
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], tnt_data.StepSizes):
        batch, sizes = data
        if tf.is_tensor(sizes.local) and sizes.local.shape.rank == 1:
            # A PyDataset's sizes carry a dimension of 1: Keras' loop wants one on every array.
            sizes = tnt_data.StepSizes(tf.reshape(sizes.local, []), tf.reshape(sizes.total, []))
        return batch, sizes
    return data, None


def first_tensor(x) -> tf.Tensor:
    """The first tensor of an input structure: what ops wait on to wait for the data."""
    return next(t for t in tf.nest.flatten(x) if t is not None)


def local_batch_size(x) -> tf.Tensor:
    return tf.shape(first_tensor(x))[0]


def nonempty(structure, local_n: tf.Tensor):
    """``structure`` with each tensor replaced by one zero sample when the batch is empty.

    A rank whose micro-batch of the last step is empty must still run the step (it
    takes part in the allreduce), but some TensorFlow kernels mishandle empty batches
    (oneDNN's Conv2D returns a wrongly shaped result for 0 samples). The padded sample's
    gradient and metric contributions are masked to zero, so it changes nothing.
    """

    def zero(t):
        return tf.zeros([1, *t.shape[1:]], t.dtype) if t.shape[1:].is_fully_defined() else \
            tf.zeros(tf.concat([[1], tf.shape(t)[1:]], 0), t.dtype)

    flat = tf.nest.flatten(structure)
    tensors = [t for t in flat if t is not None]
    if not tensors:
        return structure
    # One cond for every tensor of the batch (not one each): fewer ops to trace per step.
    chosen = tf.cond(local_n > 0, lambda: list(tensors), lambda: [zero(t) for t in tensors])
    padded = iter(chosen)
    out = []
    for t in flat:
        if t is None:
            out.append(None)
            continue
        p = next(padded)
        p.set_shape([None, *t.shape[1:]])  # not t's: a statically empty batch is not empty now
        out.append(p)
    return tf.nest.pack_sequence_as(structure, out)


def overrides(model: keras.Model, step: str) -> bool:
    """True when ``model``'s class defines its own ``train_step``/``test_step``/``predict_step``."""
    return getattr(type(model), step) is not getattr(keras.Model, step)


def allgather_rows(tensor: tf.Tensor, comm=None) -> tf.Tensor:
    """Concatenate every rank's micro-batch outputs in rank order (= global batch order),
    over ``comm`` (default: the whole job)."""
    import tnt_comm

    gather = tnt_comm.allgather if comm is None else comm.allgather
    out = tf.numpy_function(
        lambda a: gather(a), [tensor], tensor.dtype, stateful=True, name="tnt_allgather"
    )
    out.set_shape([None, *tensor.shape[1:]])
    return out
