"""GraphReducer with an engine that has no native handle (one process, no launch).

Stand-in engines (the training benchmark's ``tnt_nocomm`` contender, which exchanges
nothing) have the engine's Python interface but no C++ core to hand to the native ops;
the reducer must drive them through ``tf.numpy_function`` instead of failing.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tnt_comm
from tarantella._core import reducer as _reducer


class HandlelessEngine:
    """Sums nothing (one process): returns each bucket's slots as submitted, and counts calls."""

    built: list[HandlelessEngine] = []

    def __init__(self, specs, threshold_bytes, op=None, comm=None, slot_alignment: int = 1) -> None:
        HandlelessEngine.built.append(self)
        self.specs = list(specs)
        self.plan = [[i] for i in range(len(self.specs))]  # one bucket per slot, no padding
        self.slot_offsets = [0] * len(self.specs)
        self.submits: list[int] = []
        self._got: dict[int, np.ndarray] = {}

    def submit_many(self, indices, arrays) -> None:
        for i, a in zip(indices, arrays):
            self.submits.append(i)
            self._got[i] = np.array(a, copy=True).reshape(-1)

    def wait_buckets(self) -> list[np.ndarray]:
        return [self._got[b[0]] for b in self.plan]


def test_an_engine_without_a_native_handle_runs_through_numpy_function(monkeypatch):
    monkeypatch.setattr(tnt_comm, "FusedAllreduce", HandlelessEngine)
    slots = [_reducer.Slot("a", (2, 3), tf.float32), _reducer.Slot("b", (4,), tf.float32)]
    reducer = _reducer.GraphReducer(slots, threshold_bytes=0)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1.5, -2.0, 0.25, 8.0], np.float32)

    out = tf.function(lambda x, y: reducer.reduce([x, y]))(tf.constant(a), tf.constant(b))

    np.testing.assert_array_equal(out[0].numpy(), a)
    np.testing.assert_array_equal(out[1].numpy(), b)
    assert sorted(HandlelessEngine.built[-1].submits) == [0, 1]  # the stand-in's own submit ran
