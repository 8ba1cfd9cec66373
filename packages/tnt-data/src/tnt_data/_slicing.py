"""Cut one global batch (any nested structure) into a rank's micro-batch, inside tf.data."""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from tnt_data.errors import DistributionError


class StepSizes(NamedTuple):
    """Samples of one step: this rank's (``local``) and all ranks' together (``total``).

    A training loop weights its local gradient by ``local / total``.
    """

    local: tf.Tensor
    total: tf.Tensor


def rank_range(n: tf.Tensor, rank: Any, size: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """(start, length) of ``rank``'s slice of a batch of ``n``: the rule of _plan, in TF."""
    n = tf.cast(n, tf.int64)
    rank, size = tf.cast(rank, tf.int64), tf.cast(size, tf.int64)
    base, extra = n // size, n % size
    start = rank * base + tf.minimum(rank, extra)
    length = base + tf.cast(rank < extra, tf.int64)
    return start, length


def check_batched_spec(spec: Any) -> None:
    """Refuse, before iterating, components that have no batch dimension."""
    for path, s in _flat_with_paths(spec):
        if isinstance(s, (tf.TensorSpec, tf.RaggedTensorSpec, tf.SparseTensorSpec)):
            if s.shape.rank == 0:
                raise DistributionError(
                    f"element component {path or '<element>'} is a scalar after the batch, so "
                    f"it cannot be split into micro-batches (a map after the batch that "
                    f"reduces over the batch?). Do that reduction in the model, or pass "
                    f"tnt_distribute_dataset=False and shard by hand."
                )
        else:
            raise DistributionError(
                f"element component {path or '<element>'} is a {type(s).__name__}; tnt_data "
                f"splits only Tensor, RaggedTensor and SparseTensor components. Pass "
                f"tnt_distribute_dataset=False and shard by hand."
            )


def _flat_with_paths(spec: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Leaves of a structure with readable paths, in tf.nest.flatten order."""
    if isinstance(spec, dict):
        items = [(str(k), spec[k]) for k in sorted(spec)]
    elif isinstance(spec, (list, tuple)):
        names = getattr(spec, "_fields", None) or [str(i) for i in range(len(spec))]
        items = list(zip(names, spec))
    else:
        return [(prefix, spec)]
    out: list[tuple[str, Any]] = []
    for name, sub in items:
        out += _flat_with_paths(sub, f"{prefix}/{name}" if prefix else name)
    return out


def _rows(x: Any) -> tf.Tensor:
    if isinstance(x, tf.RaggedTensor):
        return x.nrows(out_type=tf.int64)
    if isinstance(x, tf.SparseTensor):
        return x.dense_shape[0]
    return tf.shape(x, out_type=tf.int64)[0]


def _take(x: Any, start: tf.Tensor, length: tf.Tensor) -> Any:
    if isinstance(x, tf.SparseTensor):
        rest = x.dense_shape[1:]
        return tf.sparse.slice(
            x,
            tf.concat([[start], tf.zeros_like(rest)], 0),
            tf.concat([[length], rest], 0),
        )
    return x[start : start + length]


@tf.function(autograph=False, reduce_retracing=True)
def _cut(element: Any, rank: tf.Tensor, size: tf.Tensor, with_sizes: bool) -> Any:
    # One trace per element structure, shared by every rank and every distribute() call:
    # a map calling it is cheap to build (rank and size are arguments, not constants).
    flat = tf.nest.flatten(element)
    n = _rows(flat[0])
    checks = []
    if len(flat) > 1:
        rows = tf.stack([_rows(x) for x in flat])
        checks.append(tf.debugging.Assert(
            tf.reduce_all(tf.equal(rows, n)),
            ["tnt_data: components of one batch have different batch sizes:", rows],
        ))
    with tf.control_dependencies(checks):
        start, length = rank_range(n, rank, size)
    out = tf.nest.pack_sequence_as(element, [_take(x, start, length) for x in flat])
    return (out, StepSizes(length, n)) if with_sizes else out


def slicer(spec: Any, rank: int, size: int, with_sizes: bool):
    """A function for Dataset.map that keeps ``rank``'s share of each batch."""

    @tf.autograph.experimental.do_not_convert  # plain TF ops: skip slow conversion
    def fn(*args: Any) -> Any:
        # map() unpacks a tuple element into positional arguments; pack it back.
        element = args if type(spec) is tuple else args[0]
        return _cut(element, tf.constant(rank, tf.int64), tf.constant(size, tf.int64), with_sizes)

    return fn


def split_batches(dataset: tf.data.Dataset, *, rank: int, size: int, with_sizes: bool = False) -> tf.data.Dataset:
    """Rank ``rank``'s share of every element of an already batched ``dataset``.

    For pipelines whose batches ``distribute`` cannot read (made by a ``map`` that
    gathers rows, as Keras' array adapter does): every rank runs the whole pipeline and
    keeps its contiguous slice of each batch, by the same rule as ``distribute``.
    """
    from tnt_data import _plan

    _plan.check_rank_size(rank, size)
    check_batched_spec(dataset.element_spec)
    return dataset.map(slicer(dataset.element_spec, rank, size, with_sizes))
