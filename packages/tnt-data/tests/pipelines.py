"""The pipelines of the test matrix, and the check that N simulated ranks equal serial.

Every sample carries an integer id; ``ids(element)`` reads the ids of one (micro-)batch so
the check can compare what ranks process with what the serial pipeline produces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

import tnt_data

Make = Callable[[int, int, bool, "int | None"], tf.data.Dataset]


@dataclass(frozen=True)
class Pipeline:
    name: str
    make: Make  # (length, global batch, drop_remainder, shuffle seed) -> batched dataset
    ids: Callable[[object], np.ndarray]
    unseeded: bool = False  # the user's shuffle has no seed: distribute() supplies one
    epochs: int = 1
    strategy: str = "after_batch"  # what split="auto" must choose for N > 1
    shuffle_seed: int | None = None  # passed to distribute()
    steps: Callable[[int, int, bool], int] | None = None  # serial batches, if not len/B


def _first(e: object) -> np.ndarray:
    return np.asarray(e[0])


def _repeats(length: int) -> int:
    return next((r for r in (2, 3, 5, 7) if length % r == 0), 1)


# The functions of the test pipelines use plain TF ops: no AutoGraph conversion (it re-parses
# the source on every trace, which dominated the run time of this suite).
plain = tf.autograph.experimental.do_not_convert


@plain
def _with_float(x):
    return x, tf.cast(x, tf.float32)


@plain
def _affine(i, f):
    return i, f * 2.0 + 1.0


@plain
def _ragged_row(x):
    return tf.fill([x % 3 + 1], x)


@plain
def _dict_sample(x):
    return ({"id": x, "image": tf.fill([2, 2], tf.cast(x, tf.float32))},
            {"label": x % 3, "weight": tf.cast(x, tf.float32) / 2.0})


@plain
def _plus_one(x):
    return x + 1


@plain
def _odd(x):
    return x % 2 == 1


@plain
def _even(x):
    return x % 2 == 0


@plain
def _half(x):
    return x // 2


@plain
def _non_negative(x):
    return x >= 0


@plain
def _half_and_self(x):
    return x // 2, x


@plain
def _with_negative(x):
    return x, -x


@plain
def _pair_range(x):
    return tf.data.Dataset.range(2 * x, 2 * x + 2)


def batch_prefetch(n: int, b: int, drop: bool, seed: int | None) -> tf.data.Dataset:
    return tf.data.Dataset.range(n).batch(b, drop_remainder=drop).prefetch(2)


def shuffle_seeded(n: int, b: int, drop: bool, seed: int | None) -> tf.data.Dataset:
    ds = tf.data.Dataset.from_tensor_slices((np.arange(n), np.arange(n) * 10.0))
    return ds.shuffle(n, seed=7).batch(b, drop_remainder=drop)


def shuffle_unseeded(n: int, b: int, drop: bool, seed: int | None) -> tf.data.Dataset:
    return tf.data.Dataset.range(n).shuffle(max(n // 2, 1), seed=seed).batch(b, drop_remainder=drop)


def map_cache_shuffle_take_repeat_map(n: int, b: int, drop: bool, seed: int | None) -> tf.data.Dataset:
    reps = _repeats(n)
    ds = tf.data.Dataset.range(n // reps + 3).map(_with_float)
    ds = ds.cache().shuffle(n, seed=seed).take(n // reps).repeat(reps)
    return ds.map(_affine, num_parallel_calls=2).batch(b, drop_remainder=drop)


def padded(n: int, b: int, drop: bool, seed: int | None) -> tf.data.Dataset:
    ds = tf.data.Dataset.range(n).map(_ragged_row)
    return ds.padded_batch(b, padded_shapes=[None], padding_values=np.int64(-1), drop_remainder=drop)


def dict_elements(n: int, b: int, drop: bool, seed: int | None) -> tf.data.Dataset:
    ds = tf.data.Dataset.range(n).map(_dict_sample)
    return ds.batch(b, drop_remainder=drop).prefetch(1)


def filter_before_batch(n: int, b: int, drop: bool, seed: int | None) -> tf.data.Dataset:
    # the filter right before the batch decides positions: no early split possible
    ds = tf.data.Dataset.range(2 * n).map(_plus_one).filter(_odd)
    ds = ds.map(_half, num_parallel_calls=2).filter(_non_negative)
    return ds.batch(b, drop_remainder=drop)


def filter_then_map(n: int, b: int, drop: bool, seed: int | None) -> tf.data.Dataset:
    # a filter below the maps: every rank filters all samples, then maps only its own
    ds = tf.data.Dataset.range(2 * n).filter(_even)
    return ds.map(_half_and_self).batch(b, drop_remainder=drop)


def flat_map(n: int, b: int, drop: bool, seed: int | None) -> tf.data.Dataset:
    ds = tf.data.Dataset.range(n // 2 + 1).flat_map(_pair_range)
    return ds.take(n).map(_with_negative).batch(b, drop_remainder=drop)


def interleave(n: int, b: int, drop: bool, seed: int | None) -> tf.data.Dataset:
    @plain
    def shard(s):
        return tf.data.Dataset.range(s, n, 4)

    ds = tf.data.Dataset.range(4).interleave(
        shard, cycle_length=2, block_length=3, num_parallel_calls=2, deterministic=True
    )
    return ds.batch(b, drop_remainder=drop)


def _dict_ids(e: object) -> np.ndarray:
    x, y = e
    ids = np.asarray(x["id"])
    # every component of a sample must stay with its id
    assert (np.asarray(x["image"])[:, 0, 0] == ids).all()
    assert (np.asarray(y["label"]) == ids % 3).all()
    assert (np.asarray(y["weight"]) == ids / 2).all()
    return ids


def _pair_ids(e: object) -> np.ndarray:
    i, f = e
    assert (np.asarray(f) == np.asarray(i) * 2.0 + 1.0).all()
    return np.asarray(i)


PIPELINES = [
    Pipeline("batch+prefetch", batch_prefetch, np.asarray),
    Pipeline("shuffle(seed)+batch", shuffle_seeded, _first),
    Pipeline("shuffle(no seed)+batch, 2 epochs", shuffle_unseeded, np.asarray, unseeded=True, epochs=2,
             shuffle_seed=1234),
    Pipeline("map+cache+shuffle+take+repeat+map+batch", map_cache_shuffle_take_repeat_map,
             _pair_ids, unseeded=True, strategy="early"),
    Pipeline("padded_batch", padded, lambda e: np.asarray(e)[:, 0] if np.asarray(e).size else np.zeros(0)),
    Pipeline("dict elements", dict_elements, _dict_ids, strategy="early"),
    Pipeline("filter before batch", filter_before_batch, np.asarray),
    Pipeline("filter, map, batch", filter_then_map, _first, strategy="early"),
    Pipeline("flat_map", flat_map, _first, strategy="early"),
    Pipeline("interleave", interleave, np.asarray),
]


def same_elements(a: object, b: object) -> bool:
    """Exact equality of two nests of arrays (values, shapes and dtypes)."""
    fa = [np.asarray(x) for x in tf.nest.flatten(a)]
    fb = [np.asarray(x) for x in tf.nest.flatten(b)]
    return len(fa) == len(fb) and all(
        x.shape == y.shape and x.dtype == y.dtype and (x == y).all() for x, y in zip(fa, fb)
    )


def epochs_of(ds: tf.data.Dataset, epochs: int) -> list[list[object]]:
    """Elements of each pass over ``ds`` (each pass is a fresh iterator, as Keras does)."""
    return [list(ds.as_numpy_iterator()) for _ in range(epochs)]


def rank_outputs(p: Pipeline, size: int, gbs: int, length: int, drop: bool,
                 split: str) -> list[list[list[object]]]:
    """Each rank's elements per epoch, without the serial check (for comparing splits)."""
    user = p.make(length, gbs, drop, None)
    return [
        epochs_of(tnt_data.distribute(user, rank=r, size=size, split=split,
                                      shuffle_seed=p.shuffle_seed), p.epochs)
        for r in range(size)
    ]


def check_case(p: Pipeline, size: int, gbs: int, length: int, drop: bool,
               split: str = "auto") -> list[list[list[object]]]:
    """Assert that ``size`` simulated ranks process exactly the serial batches.

    Returns each rank's elements per epoch, so callers can compare split strategies.
    """
    case = f"[{p.name}, N={size}, B={gbs}, L={length}, drop={drop}, split={split}]"
    shuffle_seed = p.shuffle_seed
    seed = (tnt_data.DEFAULT_SHUFFLE_SEED if shuffle_seed is None else shuffle_seed) if p.unseeded else None
    # The serial reference is the user's own pipeline, iterated by TensorFlow alone; an
    # unseeded shuffle must behave as if the user had written shuffle(seed=shuffle_seed).
    serial = epochs_of(p.make(length, gbs, drop, seed), p.epochs)
    user = p.make(length, gbs, drop, None)  # what the user passes (shuffle without a seed)
    ranks = []
    for r in range(size):
        local = tnt_data.distribute(user, rank=r, size=size, split=split, shuffle_seed=shuffle_seed)
        card = int(local.cardinality())
        if int(user.cardinality()) >= 0:
            assert card == len(serial[0]), f"{case} rank {r}: cardinality {card} != {len(serial[0])}"
        ranks.append(epochs_of(local, p.epochs))
    if p.unseeded and p.epochs > 1:
        firsts = [np.concatenate([p.ids(b) for b in ep]).tolist() for ep in serial]
        assert firsts[0] != firsts[1], f"{case}: the serial reference did not reshuffle"
    full, rest = divmod(length, gbs)
    expect_steps = full + (1 if rest and not drop else 0)
    if p.steps is not None:
        expect_steps = p.steps(length, gbs, drop)
    for e in range(p.epochs):
        assert len(serial[e]) == expect_steps, f"{case}: serial reference has {len(serial[e])} batches"
        for r in range(size):
            assert len(ranks[r][e]) == len(serial[e]), (
                f"{case} epoch {e}: rank {r} has {len(ranks[r][e])} steps, serial {len(serial[e])}"
            )
        for k, batch in enumerate(serial[e]):
            want = p.ids(batch)
            parts = [p.ids(ranks[r][e][k]) for r in range(size)]
            sizes = [len(x) for x in parts]
            assert max(sizes) - min(sizes) <= 1, f"{case} epoch {e} step {k}: sizes {sizes}"
            # the documented rule: the first B_k % N ranks take one extra sample
            rule = [len(want) // size + (r < len(want) % size) for r in range(size)]
            assert sizes == rule, f"{case} epoch {e} step {k}: sizes {sizes}, rule {rule}"
            got = np.concatenate(parts) if parts else np.zeros(0)
            assert sorted(got.tolist()) == sorted(want.tolist()), (
                f"{case} epoch {e} step {k}: ranks {[x.tolist() for x in parts]} vs serial {want.tolist()}"
            )
            # contiguous slices in rank order: concatenation is the serial batch itself
            assert got.tolist() == want.tolist(), f"{case} epoch {e} step {k}: order"
    return ranks
