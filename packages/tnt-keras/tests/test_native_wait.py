"""TntFusedWait's outputs are the engine's buckets, borrowed (one process, no launch).

The wait op hands TensorFlow each reduced bucket without copying it (Note [Wait outputs
borrow the buckets] in tarantella/native/tnt_tf_ops.cc): a copy was a second full gradient
set during every update (docs/memory.md). These checks call the native ops eagerly on a real
engine over one rank: an output kept past the next round keeps its values (the engine
reduces that round elsewhere), and once the outputs are dropped the next round's outputs
are the same memory again (no copy, no new set per step).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tnt_comm
from tarantella import native

SPECS = [tnt_comm.TensorSpec(f"w{i}", 17 + 5 * i, "float32") for i in range(3)]


@pytest.fixture(scope="module")
def ops():
    module = native.ops()
    assert module is not None, f"native ops unavailable: {native.why_not}"
    return module


def _round(ops, engine: tnt_comm.FusedAllreduce, scale: float) -> list[tf.Tensor]:
    """Submit every tensor (tensor i holds (i + 1) * scale) and return the wait's buckets."""
    values = [tf.fill([s.count], np.float32((i + 1) * scale)) for i, s in enumerate(SPECS)]
    start, keep = tf.zeros([]), tf.constant(True)
    tokens = [ops.tnt_fused_submit(start, keep, [values[i] for i in m], engine=engine.native_handle(),
                                   members=m, keep_from=0) for m in engine.plan]
    counts = [engine.slot_offsets[m[-1]] + SPECS[m[-1]].count - engine.slot_offsets[m[0]] for m in engine.plan]
    return ops.tnt_fused_wait(tokens, Tout=[tf.float32] * len(engine.plan), engine=engine.native_handle(),
                              counts=counts)


def _check(engine: tnt_comm.FusedAllreduce, buckets: list[tf.Tensor], scale: float) -> None:
    """Every slot holds its tensor's value (one rank: the SUM is the value). No view of a
    bucket outlives the call: a view would hold the bucket, as a kept output does."""
    for i, s in enumerate(SPECS):
        b = next(k for k, m in enumerate(engine.plan) if i in m)
        start = engine.slot_offsets[i] - engine.slot_offsets[engine.plan[b][0]]
        got = buckets[b].numpy()[start:start + s.count]
        assert (got == (i + 1) * scale).all(), (i, scale, got)


def _address(t: tf.Tensor) -> int:
    # TensorFlow's numpy() copies; _numpy() is the view of a CPU tensor's own memory.
    return t._numpy().__array_interface__["data"][0]


def test_a_kept_output_keeps_its_values_and_dropped_outputs_are_reused(ops):
    with tnt_comm.FusedAllreduce(SPECS, 64, comm=tnt_comm.world(), slot_alignment=64) as engine:
        assert len(engine.plan) >= 2, engine.plan  # several buckets, so the check sees each
        first = _round(ops, engine, 1.0)
        first_at = [_address(t) for t in first]
        second = _round(ops, engine, 10.0)  # `first` still held: reduced in fresh buckets
        second_at = [_address(t) for t in second]
        _check(engine, first, 1.0)
        _check(engine, second, 10.0)
        assert all(a % 64 == 0 for a in first_at), first_at  # the bucket itself, not a copy
        assert not set(first_at) & set(second_at), (first_at, second_at)
        del first, second
        # Nothing held: the engine's buckets again, no copy. Reuse reads the buffer's
        # reference count at submit time, which can be stale for a moment (the
        # communication thread dropping its copy) and then allocates a fresh bucket
        # (buffer.cc): reuse must show within a few rounds, not in every one.
        previous, reused = second_at, 0
        for k in range(12):
            third = _round(ops, engine, 100.0 + k)
            third_at = [_address(t) for t in third]
            _check(engine, third, 100.0 + k)
            reused += third_at == previous
            previous = third_at
            del third
        assert reused >= 1, f"no round of 12 reused its dropped buckets ({reused})"
