"""TntFusedWait's and TntFusedWaitBucket's outputs are the engine's buckets, borrowed (one
process, no launch); the step graph waits for each bucket on its own.

The wait op hands TensorFlow each reduced bucket without copying it (Note [Wait outputs
borrow the buckets] in tarantella/native/tnt_tf_ops.cc): a copy was a second full gradient
set during every update (docs/memory.md). These checks call the native ops eagerly on a real
engine over one rank: an output kept past the next round keeps its values (the engine
reduces that round elsewhere), and once the outputs are dropped the next round's outputs
are the same memory again (no copy, no new set per step).
"""

from __future__ import annotations

import os

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
        # Nothing held: with TNT_COMM_TRANSIENT_BUCKETS=0 the engine's buckets again, no
        # copy (by default they were freed with their last holder). Reuse reads the buffer's
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
        if os.environ.get("TNT_COMM_TRANSIENT_BUCKETS", "1") == "0":  # kept buckets (else freed each round)
            assert reused >= 1, f"no round of 12 reused its dropped buckets ({reused})"


# -- TntFusedWaitBucket: one bucket at a time (Note [One wait per bucket]) ----------------

def _counts(engine: tnt_comm.FusedAllreduce) -> list[int]:
    return [engine.slot_offsets[m[-1]] + SPECS[m[-1]].count - engine.slot_offsets[m[0]] for m in engine.plan]


def test_a_bucket_is_handed_out_before_later_buckets_are_submitted(ops):
    """Eagerly: bucket b's wait returns its SUM while bucket b + 1 is not even submitted (the
    all-at-once wait would block there forever), and the round re-arms after the last one."""
    with tnt_comm.FusedAllreduce(SPECS, 64, comm=tnt_comm.world(), slot_alignment=64) as engine:
        handle, counts = engine.native_handle(), _counts(engine)
        assert len(engine.plan) >= 2, engine.plan
        for scale in (1.0, 10.0):  # the second round: the first re-armed the engine
            values = [tf.fill([s.count], np.float32((i + 1) * scale)) for i, s in enumerate(SPECS)]
            start, keep, after = tf.zeros([]), tf.constant(True), None
            buckets = []
            for b, m in enumerate(engine.plan):
                token = ops.tnt_fused_submit(start, keep, [values[i] for i in m], engine=handle,
                                             members=m, keep_from=0)
                flat, after = ops.tnt_fused_wait_bucket([token] if after is None else [token, after],
                                                        T=tf.float32, engine=handle, bucket=b, count=counts[b])
                assert _address(flat) % 64 == 0  # the bucket itself, borrowed
                buckets.append(flat)
            _check(engine, buckets, scale)


def test_the_step_graph_waits_bucket_by_bucket_outside_the_side_effect_chain():
    """In a traced step every bucket has its own wait, ordered by its data inputs only (its
    own submit, the previous wait), with no control input from tf.function's chain of side
    effects: that chain would order each stateful op after the previous one, and whatever
    comes after the reduction after every bucket's wait (a full gradient set alive)."""
    from tarantella._core.reducer import GraphReducer, Slot

    slots = [Slot(s.name, (s.count,), tf.float32) for s in SPECS]
    reducer = GraphReducer(slots, 64, tnt_comm.world())
    counter = tf.Variable(0.0)
    try:
        @tf.function(autograph=False)
        def step(*values):
            counter.assign_add(1.0)  # a side effect earlier in program order
            return reducer.reduce(list(values))

        values = [tf.fill([s.count], np.float32(i + 1)) for i, s in enumerate(SPECS)]
        graph = step.get_concrete_function(*values).graph
        waits = [op for op in graph.get_operations() if op.type == "TntFusedWaitBucket"]
        assert len(waits) == len(reducer.plan) >= 2, (len(waits), reducer.plan)
        assert not [op for op in graph.get_operations() if op.type == "TntFusedWait"]
        for b, op in enumerate(waits):
            assert op.get_attr("bucket") == b
            assert not op.control_inputs, (b, [c.name for c in op.control_inputs])
            feeds = [t.op.type for t in op.inputs]
            assert feeds == (["TntFusedSubmit"] if b == 0 else ["TntFusedSubmit", "TntFusedWaitBucket"]), feeds
        out = step(*values)
        for i in range(len(SPECS)):
            assert (out[i].numpy() == i + 1).all(), (i, out[i])
    finally:
        reducer.close()


def test_large_buckets_launch_first_and_the_waits_follow_the_launch_order():
    """Note [Large buckets first]: buckets over the fusion threshold (one tensor each) are
    launched before the small ones, so a small gradient computed late does not hold them
    back; which tensors share a bucket is unchanged, and the step's waits are chained in
    that order (a wait chained after a bucket launched last would hold every bucket)."""
    from tarantella._core.reducer import GraphReducer, Slot

    shapes = [(1,), (3,), (40,), (5,), (50,), (2,)]  # a count, then small/large interleaved
    slots = [Slot(f"s{i}", s, tf.float32) for i, s in enumerate(shapes)]
    reducer = GraphReducer(slots, 64, tnt_comm.world())  # 64 bytes: (40,) and (50,) are larger
    try:
        assert reducer.plan == [[0, 1], [2], [3], [4], [5]], reducer.plan  # the bucket rule, unchanged
        order = reducer._engine.launch_order
        assert order == [1, 3, 0, 2, 4], order  # the large buckets [2] and [4] first

        @tf.function(autograph=False)
        def step(*values):
            return reducer.reduce(list(values), keep=tf.constant(False), keep_from=1)

        values = [tf.fill(s, np.float32(i + 1)) for i, s in enumerate(shapes)]
        graph = step.get_concrete_function(*values).graph
        waits = [op for op in graph.get_operations() if op.type == "TntFusedWaitBucket"]
        after = {op.get_attr("bucket"): (op.inputs[1].op.get_attr("bucket") if len(op.inputs) == 2 else None)
                 for op in waits}  # bucket -> the bucket whose wait it follows
        chain = [next(b for b, a in after.items() if a is None)]
        while len(chain) < len(waits):
            chain.append(next(b for b, a in after.items() if a == chain[-1]))
        assert chain == order, (chain, after)
        out = step(*values)  # a rank without data: zeros from slot 1 on
        for i, s in enumerate(shapes):
            assert out[i].shape == s and (out[i].numpy() == (1 if i == 0 else 0)).all(), (i, out[i])
    finally:
        reducer.close()
