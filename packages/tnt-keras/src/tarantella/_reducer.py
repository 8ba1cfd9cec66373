"""Graph glue between a TensorFlow step function and tnt_comm's fused allreduce engine.

A step hands each tensor to the engine with :meth:`GraphReducer.submit` the moment the
tensor exists in the graph (the TF executor runs the submit op as soon as its input is
computed, so early gradients are on the wire while backprop continues), then one
:meth:`GraphReducer.wait` op returns every SUM-reduced tensor. The engine buckets the
tensors by a plan that is a pure function of the specs and the fusion threshold, so every
rank issues the same collectives in the same order.

``tf.numpy_function`` is not XLA-compilable; steps that use a reducer therefore run with
``jit_compile=False`` (see docs/keras.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

import tnt_comm

_TOKEN = np.zeros((), dtype=np.int32)


@dataclass(frozen=True)
class Slot:
    """One tensor the reducer expects per step: a name for error messages, shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: tf.DType

    @property
    def count(self) -> int:
        return math.prod(self.shape)


class GraphReducer:
    """A fused SUM-allreduce of a fixed, ordered list of tensors, usable inside tf.function."""

    def __init__(self, slots: Sequence[Slot], threshold_bytes: int) -> None:
        self.slots = list(slots)
        specs = [tnt_comm.TensorSpec(s.name, s.count, s.dtype.as_numpy_dtype) for s in self.slots]
        self._engine = tnt_comm.FusedAllreduce(specs, threshold_bytes, tnt_comm.Op.SUM)

    @property
    def plan(self) -> list[list[int]]:
        return self._engine.plan

    def _submit_np(self, index: int, value: np.ndarray) -> np.ndarray:
        self._engine.submit(index, np.ascontiguousarray(value).reshape(-1))
        return _TOKEN

    def _wait_np(self, *_tokens: np.ndarray) -> list[np.ndarray]:
        return list(self._engine.wait())

    def submit(self, index: int, value: tf.Tensor) -> tf.Tensor:
        """Queue ``value`` as slot ``index``; returns a token the wait op depends on."""
        slot = self.slots[index]
        value = tf.cast(value, slot.dtype) if value.dtype != slot.dtype else value
        return tf.numpy_function(
            lambda v, i=index: self._submit_np(i, v),
            [value],
            tf.int32,
            stateful=False,
            name="tnt_submit",
        )

    def wait(self, tokens: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Block until every slot is reduced; returns the sums, shaped like the slots."""
        flat = tf.numpy_function(
            self._wait_np,
            list(tokens),
            [s.dtype for s in self.slots],
            stateful=True,
            name="tnt_wait",
        )
        out = []
        for slot, tensor in zip(self.slots, flat):
            tensor.set_shape([slot.count])
            out.append(tf.reshape(tensor, slot.shape))
        return out

    def close(self) -> None:
        self._engine.close()
