"""Bad input gets a DistributionError naming the problem, the transformation and the fix."""

from __future__ import annotations

import pytest
import tensorflow as tf

import tnt_data
from tnt_data import DistributionError


def _raises(words: list[str], **kwargs) -> None:
    with pytest.raises(DistributionError) as info:
        tnt_data.distribute(**kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} not in: {info.value}"


def test_unbatched_without_micro_batch_size() -> None:
    _raises(["not batched", "dataset.batch(B)", "micro_batch_size"],
            dataset=tf.data.Dataset.range(10), rank=0, size=2)


def test_micro_batch_size_disagrees_with_the_batch() -> None:
    _raises(["batch size 10", "micro_batch_size=4", "global batch of 8"],
            dataset=tf.data.Dataset.range(30).batch(10), rank=0, size=2, micro_batch_size=4)


@pytest.mark.parametrize("m", [0, -2, 1.5, True])
def test_bad_micro_batch_size(m) -> None:
    _raises(["micro_batch_size must be an int >= 1"],
            dataset=tf.data.Dataset.range(10), rank=0, size=2, micro_batch_size=m)


@pytest.mark.parametrize(("rank", "size", "words"), [
    (2, 2, "rank must be in [0, size) = [0, 2), got 2"),
    (-1, 2, "rank must be in [0, size)"),
    (0, 0, "size must be >= 1"),
    ("0", 2, "rank must be an int"),
])
def test_bad_rank_or_size(rank, size, words: str) -> None:
    _raises([words], dataset=tf.data.Dataset.range(10).batch(2), rank=rank, size=size)


def test_unknown_transformation_after_the_batch() -> None:
    ds = tf.data.Dataset.range(20).batch(4).rebatch(2)
    _raises(["_RebatchDataset", "after a batch", "tnt_distribute_dataset=False"],
            dataset=ds, rank=0, size=2)


def test_unknown_transformation_above_an_unseeded_shuffle() -> None:
    ds = tf.data.Dataset.range(20).shuffle(20).ignore_errors().batch(4)
    _raises(["_IgnoreErrorsDataset", "seed", "tnt_distribute_dataset=False"],
            dataset=ds, rank=0, size=2)


def test_unknown_transformation_above_a_seeded_shuffle_is_fine() -> None:
    # tnt_data cannot rebuild that shuffle (so its reshuffle state stays shared with the
    # dataset passed in); it works when each rank builds its pipeline, as in a real run.
    def make() -> tf.data.Dataset:
        return tf.data.Dataset.range(20).shuffle(20, seed=3).ignore_errors().batch(4)

    serial = [b.tolist() for b in make().as_numpy_iterator()]
    ranks = [[b.tolist() for b in tnt_data.distribute(make(), rank=r, size=2).as_numpy_iterator()]
             for r in range(2)]
    assert [ranks[0][k] + ranks[1][k] for k in range(len(serial))] == serial


def test_scalar_component_after_the_batch() -> None:
    ds = tf.data.Dataset.range(20).batch(4).map(lambda b: (b, tf.reduce_sum(b)))
    _raises(["1", "scalar after the batch", "cannot be split"], dataset=ds, rank=0, size=2)


def test_zip_of_batched_and_unbatched() -> None:
    ds = tf.data.Dataset.zip((tf.data.Dataset.range(20).batch(4), tf.data.Dataset.range(5)))
    _raises(["part of the pipeline is batched", "Batch every branch"], dataset=ds, rank=0, size=2)


def test_differently_batched_branches() -> None:
    a, b = tf.data.Dataset.range(20).batch(4), tf.data.Dataset.range(20).batch(5)
    _raises(["different sizes [4, 5]"], dataset=a.concatenate(b), rank=0, size=2)


def test_early_split_refused_with_the_reason() -> None:
    ds = tf.data.Dataset.range(20).map(lambda x: tf.fill([x % 3 + 1], x)).padded_batch(4)
    _raises(["split='early' is not possible", "padded_batch"], dataset=ds, rank=0, size=2, split="early")
    _raises(["split must be"], dataset=ds, rank=0, size=2, split="sideways")


def test_drop_remainder_with_a_batched_dataset() -> None:
    _raises(["drop_remainder applies only"], dataset=tf.data.Dataset.range(9).batch(3),
            rank=0, size=2, drop_remainder=True)


def test_not_a_dataset() -> None:
    _raises(["expected a tf.data.Dataset", "from_tensor_slices"], dataset=[1, 2, 3], rank=0, size=1)


def test_tensorflow_changed_how_it_stores_a_transformation() -> None:
    ds = tf.data.Dataset.range(8).batch(4)
    del ds._batch_size  # what a TensorFlow release renaming the attribute looks like
    _raises(["_BatchDataset", "'_batch_size'", tf.__version__, "tnt_distribute_dataset=False"],
            dataset=ds, rank=0, size=2)


def test_inspect_reports_the_same_problem() -> None:
    with pytest.raises(DistributionError, match="_RebatchDataset"):
        tnt_data.inspect(tf.data.Dataset.range(8).batch(4).rebatch(2))
