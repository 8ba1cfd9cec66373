"""A LossScaleOptimizer's skip decision taken on the whole gradients, as serial Keras does.

``LossScaleOptimizer.check_finite`` applies the step only if every gradient is finite,
and halves the scale otherwise. A rank of a tensor group holds only its shards of the
split layers' gradients: left alone, a rank whose shard overflowed would skip the step
and halve its scale while the others apply it, and the replicated weights, the split
layers' biases and the scale would drift apart silently (reproduced on 2 ranks: scale
128 vs 2048 after 16 steps). The whole gradient is finite exactly when every shard is,
so one allreduce of "some gradient is not finite" over the tensor group gives every rank
serial Keras' decision. With data replicas the gradients are already summed over the
replica group (identical on the ranks holding the same shard), so every tensor group
takes that same decision: the job's. Sharded replicas decide in DATA's ``Sharding``.
"""

from __future__ import annotations

import types

import keras
import tensorflow as tf

from .._core import graph_collectives as _gc
from ._collectives import _CHAIN, TensorGroup


def decide_over_group(optimizer, group: TensorGroup) -> None:
    """Make ``optimizer`` (if a LossScaleOptimizer) decide finiteness over ``group``'s
    shards: its ``check_finite`` ORs the ranks' answers (one scalar allreduce per step,
    ordered after the group's other collectives)."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or group.size == 1:
        return
    if getattr(optimizer, "_tnt_finite_over", None) is group:
        return
    own_check = type(optimizer).check_finite

    def check_finite(opt, grads):
        bad = tf.reshape(tf.cast(tf.logical_not(own_check(opt, grads)), tf.float32), [1])
        return tf.equal(_gc.allreduce(bad, group.comm, _CHAIN, "tnt_tp_finite")[0], 0.0)

    optimizer.check_finite = types.MethodType(check_finite, optimizer)
    optimizer._tnt_finite_over = group
