"""Synchronised batch normalisation: training statistics of the global batch.

Keras' BatchNormalization normalises with the mean and variance of the batch it sees; on
N ranks that is the rank's micro-batch, so training differs from serial Keras and every
replica's moving statistics drift their own way. Here the statistics are those of the
global batch, computed as Keras computes them (``tf.nn.moments``: the mean, then the mean
squared deviation from it), from sums reduced over the ranks:

    mean = sum_r sum(x_r) / sum_r n_r,   var = sum_r sum((x_r - mean)^2) / sum_r n_r

with one SUM-allreduce for (sums, count) and one for the squared deviations. The
allreduce is differentiable (its gradient is the allreduce of the incoming gradient), so
backprop also sees the global batch. Ranks must issue these collectives in the same
order even where two normalisation layers could run in parallel (a ResNet's shortcut):
each collective of a graph waits for the previous one of the same direction.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import keras
import tensorflow as tf

import tnt_comm

from . import graph_collectives as _graph_collectives
from . import internals as _internals
from . import runtime as _runtime


def _chained_allreduce(t: tf.Tensor, direction: str) -> tf.Tensor:
    """SUM over ranks of ``t`` as a graph op, ordered after the previous one of its graph."""
    return _graph_collectives.allreduce(t, tnt_comm.world(), f"batch_norm_{direction}",
                                        f"tnt_bn_allreduce_{direction}")


@tf.custom_gradient
def allreduce_sum(t: tf.Tensor):
    """Differentiable SUM over ranks: every rank's output depends on every rank's input."""

    def grad(upstream):
        return _chained_allreduce(upstream, "backward")

    return _chained_allreduce(t, "forward"), grad


_state = threading.local()


@contextlib.contextmanager
def valid_rows(local_n: tf.Tensor) -> Iterator[None]:
    """Inside a step: only the first ``local_n`` rows of a batch are samples.

    A rank whose micro-batch is empty runs its step on one placeholder row (see
    ``_step_parts.nonempty``); it must not count in the global statistics.
    """
    previous = getattr(_state, "rows", None)
    _state.rows = local_n
    try:
        yield
    finally:
        _state.rows = previous


def global_moments(x: tf.Tensor, axes) -> tuple[tf.Tensor, tf.Tensor]:
    """Mean and variance over ``axes`` of the union of all ranks' ``x``."""
    dtype = x.dtype
    if dtype in (tf.float16, tf.bfloat16):
        x = tf.cast(x, tf.float32)
    rows = getattr(_state, "rows", None)
    keep = tf.ones_like(x)
    if rows is not None and 0 in {a % x.shape.rank for a in axes}:
        in_batch = tf.range(tf.shape(x)[0]) < tf.cast(rows, tf.int32)
        keep = keep * _expand(tf.cast(in_batch, x.dtype), x, [i for i in range(1, x.shape.rank)])
    local_sum = tf.reduce_sum(x * keep, axis=axes)
    count = tf.reduce_sum(keep) / tf.cast(tf.maximum(tf.size(local_sum), 1), x.dtype)  # float32 or 64
    packed = allreduce_sum(tf.concat([tf.reshape(local_sum, [-1]), tf.reshape(count, [1])], 0))
    total = tf.maximum(packed[-1], 1.0)
    mean = tf.reshape(packed[:-1], tf.shape(local_sum)) / total
    deviation = tf.square(x - tf.stop_gradient(_expand(mean, x, axes))) * keep
    variance = allreduce_sum(tf.reduce_sum(deviation, axis=axes)) / total
    if dtype != x.dtype:
        mean, variance = tf.cast(mean, dtype), tf.cast(variance, dtype)
    return mean, variance


def _expand(stat: tf.Tensor, x: tf.Tensor, axes) -> tf.Tensor:
    rank = x.shape.rank
    shape = [1 if i in {a % rank for a in axes} else -1 for i in range(rank)]
    return tf.reshape(stat, shape)


def _sync_moments(layer: keras.layers.BatchNormalization, inputs, mask):
    if mask is not None or _runtime.get_size() == 1:
        return type(layer)._moments(layer, inputs, mask)
    return global_moments(inputs, _internals.batch_norm_reduction_axes(layer))


@keras.saving.register_keras_serializable(package="tarantella")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with the statistics of the global batch.

    A drop-in replacement: same arguments, same variables, same config (a saved model
    loads into plain ``BatchNormalization`` via ``from_config``). On one rank it is
    Keras' layer; on N ranks training uses the mean and variance over all ranks'
    micro-batches, so a model trains as serial Keras does, and the moving statistics
    stay identical on every rank. Masked inputs use the local statistics.
    """

    def _moments(self, inputs, mask):
        if mask is not None or _runtime.get_size() == 1:
            return super()._moments(inputs, mask)
        return global_moments(inputs, _internals.batch_norm_reduction_axes(self))


def synchronise(model: keras.Model) -> int:
    """Make every BatchNormalization layer of ``model`` use global statistics.

    Patches the layers in place (the model's structure and files stay those of plain
    Keras); returns how many layers were changed.
    """

    changed = 0
    for layer in _internals.all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and not isinstance(
            layer, SyncBatchNormalization
        ):
            object.__setattr__(layer, "_moments", functools.partial(_sync_moments, layer))
            changed += 1
    return changed


def _is_global(layer) -> bool:
    return isinstance(layer, SyncBatchNormalization) or "_moments" in vars(layer)


def has_sync_batch_norm(model: keras.Model) -> bool:
    """True when some layer of ``model`` computes global statistics (a collective)."""

    return any(_is_global(layer) for layer in _internals.all_layers(model)
               if isinstance(layer, keras.layers.BatchNormalization))


def has_local_batch_norm(model: keras.Model) -> bool:
    """True when some BatchNormalization layer of ``model`` normalises over this rank's rows only."""

    return any(not _is_global(layer) for layer in _internals.all_layers(model)
               if isinstance(layer, keras.layers.BatchNormalization))
