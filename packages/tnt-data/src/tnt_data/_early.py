"""Early split: each rank runs the expensive 1:1 maps before the batch on its samples only.

The pipeline below the batch is cut into a *segment* of 1:1, order-keeping transformations
(map, prefetch, cache, options) right above the batch, and everything under it (source,
shuffle, repeat, filter, ...), which every rank still runs whole: it is cheap and decides
sample positions. From that raw stream each rank takes its slice of every global batch
of raw samples (the same rule as after the batch), runs the segment on those samples
only, and batches them by its micro-batch size. A rank whose slice of the last, partial
global batch is empty maps one placeholder sample there, dropped after the batch, so it
still yields that step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from tnt_data import _plan
from tnt_data._inspect import find_batches
from tnt_data._slicing import StepSizes, rank_range
from tnt_data._tfgraph import Node, rebuild

# Between the global batch and the end: transformations that act on whole batches only by
# position and count, so they act the same on the micro-batch stream.
POST_EARLY = frozenset(
    {"prefetch", "cache", "repeat", "take", "skip", "options", "assert_cardinality", "shuffle"}
)
# Between the split point and the batch: 1:1, order-keeping transformations.
SEGMENT = frozenset({"map", "prefetch", "cache", "options"})


@dataclass
class EarlyPlan:
    batch: Node
    segment: list[Node]  # from the batch's input down to the lowest transformation
    split_input: Node  # what the lowest segment transformation reads: the raw samples
    post: list[Node]  # between the end of the pipeline and the batch (end first)


def _post_batch_path(root: Node, batch: Node) -> list[Node] | None:
    path, node = [], root
    while node is not batch:
        if len(node.inputs) != 1:
            return None
        path.append(node)
        node = node.inputs[0]
    return path


def plan_early(root: Node, size: int, allow_post_maps: bool) -> tuple[EarlyPlan | None, str]:
    """An EarlyPlan, or None and the reason the pipeline must be split after the batch."""
    batches = find_batches(root)
    if len(batches) != 1:
        return None, "several batch transformations (zip/concatenate of batched datasets)"
    (batch,) = batches
    if batch.kind != "batch":
        return None, "padded_batch pads to the longest sample of the global batch"
    post = _post_batch_path(root, batch)
    if post is None:
        return None, "the batch feeds a zip or concatenate"
    allowed = POST_EARLY | ({"map"} if allow_post_maps else set())
    for node in post:
        if node.kind not in allowed:
            why = " (it may mix samples; split='early' asserts it does not)" if node.kind == "map" else ""
            return None, f"a {node.label} after the batch must see whole global batches{why}"
    if batch.params["batch_size"] < size:
        return None, "the global batch is smaller than the number of ranks"
    segment, node = [], batch.inputs[0]
    while node.kind in SEGMENT and len(node.inputs) == 1:
        segment.append(node)
        node = node.inputs[0]
    if not any(n.kind == "map" for n in segment):
        below = f" ({node.label} right before the batch decides sample positions)" if node.kind in (
            "filter", "flat_map", "interleave") else ""
        return None, f"no 1:1 map between the last shuffle/repeat/filter and the batch{below}"
    for where in (node, batch.inputs[0]):
        for spec in tf.nest.flatten(where.dataset.element_spec):
            if not isinstance(spec, tf.TensorSpec):
                return None, f"a {type(spec).__name__} sample component (early split needs dense tensors)"
    maps = sum(n.kind == "map" for n in segment)
    return EarlyPlan(batch, segment, node, post), f"{maps} map(s) before the batch run on each rank's samples only"


def call(func: Callable, element: Any) -> Any:
    """Call a tf.data function as map() does: a tuple element is unpacked into arguments."""
    return func(*element) if type(element) is tuple else func(element)


def carried(func: Callable) -> Callable:
    """``func`` on (placeholder flag, total, sample) elements, passing the tags through."""

    def fn(flag: tf.Tensor, total: tf.Tensor, element: Any) -> Any:
        return flag, total, call(func, element)

    return fn


@tf.function(autograph=False, reduce_retracing=True)
def _mine(batch: Any, rank: tf.Tensor, size: tf.Tensor) -> Any:
    """This rank's samples of a raw global batch, tagged (placeholder?, B_k) per sample.

    A tf.function: traced once per structure for all ranks (rank, size are arguments).
    """
    flat = tf.nest.flatten(batch)
    n = tf.shape(flat[0], out_type=tf.int64)[0]
    start, length = rank_range(n, rank, size)
    empty = tf.equal(length, 0)
    # An empty slice keeps sample 0 as a placeholder, so the rank still gets the step.
    start = tf.where(empty, tf.constant(0, tf.int64), start)
    count = tf.maximum(length, 1)
    part = tf.nest.pack_sequence_as(batch, [x[start : start + count] for x in flat])
    return tf.fill([count], empty), tf.fill([count], n), part


@tf.function(autograph=False, reduce_retracing=True)
def _unflag(flags: tf.Tensor, totals: tf.Tensor, batch: Any, with_sizes: bool, drop: bool) -> Any:
    # A placeholder is only ever alone in its micro-batch (the rank's empty last step).
    local = tf.reduce_sum(tf.cast(tf.logical_not(flags), tf.int64))
    if not drop:
        batch = tf.nest.map_structure(lambda x: x[:local], batch)
    return (batch, StepSizes(local, totals[0])) if with_sizes else batch


def early_batches(
    plan: EarlyPlan, raw: tf.data.Dataset, rank: int, size: int, with_sizes: bool
) -> tf.data.Dataset:
    """The rank's micro-batch stream, built on ``raw`` (the rebuilt split input)."""
    p = plan.batch.params
    gbs, drop = int(p["batch_size"]), bool(p["drop_remainder"])
    glob = raw.batch(gbs, drop_remainder=drop)
    spec = raw.element_spec

    @tf.autograph.experimental.do_not_convert  # plain TF ops: skip slow conversion
    def mine(*args: Any) -> Any:
        batch = args if type(spec) is tuple else args[0]
        return _mine(batch, tf.constant(rank, tf.int64), tf.constant(size, tf.int64))

    @tf.autograph.experimental.do_not_convert
    def unflag(flags: tf.Tensor, totals: tf.Tensor, batch: Any) -> Any:
        return _unflag(flags, totals, batch, with_sizes, drop)

    stream = glob.map(mine).unbatch()
    for node in reversed(plan.segment):
        over = {"func": carried(node.params["func"])} if node.kind == "map" else {}
        stream = rebuild(node, [stream], **over)
    local = rebuild(plan.batch, [stream], batch_size=_plan.micro_batch_size(gbs, rank, size))
    local = local.map(unflag)
    steps = int(glob.cardinality().numpy())
    if steps != tf.data.UNKNOWN_CARDINALITY:
        local = local.apply(tf.data.experimental.assert_cardinality(steps))
    return local
