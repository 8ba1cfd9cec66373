"""distribute() beyond the matrix: more transformations, sizes, strategies, work saved."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from pipelines import Pipeline, check_case, same_elements

import tnt_data


def _ids(ds: tf.data.Dataset, pick=lambda e: e) -> list[list[int]]:
    return [np.asarray(pick(e)).tolist() for e in ds.as_numpy_iterator()]


def _split(ds_of_rank, size: int, pick=lambda e: e) -> list[list[list[int]]]:
    return [_ids(ds_of_rank(r), pick) for r in range(size)]


# -- transformations before and after the batch (checked like the matrix) -----------------

def _zip_before(n, b, drop, seed):
    a = tf.data.Dataset.range(n)
    return tf.data.Dataset.zip((a, a.map(lambda x: x * 3))).batch(b, drop_remainder=drop)


def _zip_after(n, b, drop, seed):
    a = tf.data.Dataset.range(n)
    return tf.data.Dataset.zip((a.batch(b, drop_remainder=drop),
                                a.map(lambda x: x * 3).batch(b, drop_remainder=drop)))


def _concat_before(n, b, drop, seed):
    return tf.data.Dataset.range(n // 2).concatenate(tf.data.Dataset.range(n // 2, n)).batch(
        b, drop_remainder=drop)


def _concat_after(n, b, drop, seed):
    # the serial batches: those of the first part, then those of the second
    first = tf.data.Dataset.range(n // 2).batch(b, drop_remainder=drop)
    return first.concatenate(tf.data.Dataset.range(n // 2, n).batch(b, drop_remainder=drop))


def _skip_take_around(n, b, drop, seed):
    ds = tf.data.Dataset.range(n + 9).skip(4).take(n + 3).map(lambda x: (x, x + 1))
    return ds.batch(b, drop_remainder=drop).skip(1).take(4).prefetch(1)


def _post_batch_map(n, b, drop, seed):
    ds = tf.data.Dataset.range(n).map(lambda x: x * 2)
    # a map after the batch that mixes samples: only splitting after it is exact
    return ds.batch(b, drop_remainder=drop).map(lambda x: (x, x - tf.reduce_min(x)))


def _steps(n: int, b: int, drop: bool) -> int:
    return n // b if drop else -(-n // b)


def _zip_pair(e):
    a, c = e
    assert (np.asarray(c) == 3 * np.asarray(a)).all()
    return np.asarray(a)


def _mixed(e):
    return np.asarray(e[1])


EXTRA = [
    Pipeline("zip before batch", _zip_before, _zip_pair),
    Pipeline("zip after batch", _zip_after, _zip_pair),
    Pipeline("concatenate before batch", _concat_before, np.asarray),
    Pipeline("concatenate after batch", _concat_after, np.asarray,
             steps=lambda n, b, drop: _steps(n // 2, b, drop) + _steps(n - n // 2, b, drop)),
    Pipeline("skip/take before and after batch", _skip_take_around, lambda e: np.asarray(e[0]),
             strategy="early", steps=lambda n, b, drop: 4),
    Pipeline("map after batch that mixes samples", _post_batch_map, _mixed),
]


@pytest.mark.parametrize("p", EXTRA, ids=lambda p: p.name)
def test_more_transformations(p: Pipeline) -> None:
    for n in (2, 3):
        for gbs, length, drop in ((2 * n + 1, 23, False), (2 * n + 1, 23, True), (n, 4 * n, False)):
            if p.name.startswith("skip/take"):
                length = max(length, 5 * gbs + 1)  # keep 4 batches after skip(1)
            assert tnt_data.split_strategy(p.make(length, gbs, drop, None), size=n).mode == p.strategy
            auto = check_case(p, n, gbs, length, drop)
            if p.strategy == "early":
                assert same_elements(auto, check_case(p, n, gbs, length, drop, split="after_batch"))


def test_skip_take_after_batch_keeps_steps() -> None:
    ds = _skip_take_around(40, 6, False, None)
    serial = _ids(ds, lambda e: e[0])
    assert len(serial) == 4
    ranks = _split(lambda r: tnt_data.distribute(ds, rank=r, size=4), 4, lambda e: e[0])
    assert [[x for r in range(4) for x in ranks[r][k]] for k in range(4)] == serial


# -- sizes, empty micro-batches, unbatched input ------------------------------------------------

def test_global_batch_smaller_than_size_gives_empty_micro_batches() -> None:
    ds = tf.data.Dataset.range(7).map(lambda x: (x, tf.fill([3], x))).batch(2)
    ranks = [list(tnt_data.distribute(ds, rank=r, size=3).as_numpy_iterator()) for r in range(3)]
    assert [len(r) for r in ranks] == [4, 4, 4]
    assert [[len(e[0]) for e in r] for r in ranks] == [[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]]
    assert ranks[2][0][1].shape == (0, 3)  # an empty micro-batch keeps the sample shape
    assert tnt_data.split_strategy(ds, size=3).mode == "after_batch"


def test_unbatched_with_micro_batch_size_equals_batching_first() -> None:
    ds = tf.data.Dataset.range(23)
    for drop in (False, True):
        direct = _split(lambda r, drop=drop: tnt_data.distribute(
            ds, rank=r, size=2, micro_batch_size=3, drop_remainder=drop), 2)
        batched = _split(lambda r, drop=drop: tnt_data.distribute(
            ds.batch(6, drop_remainder=drop), rank=r, size=2), 2)
        assert direct == batched
        assert len(direct[0]) == (3 if drop else 4)
    # a batched dataset whose batch is micro_batch_size * size is accepted as is
    ok = tnt_data.distribute(ds.batch(6), rank=1, size=2, micro_batch_size=3)
    assert _ids(ok)[0] == [3, 4, 5]


@pytest.mark.parametrize("split", ["auto", "after_batch"])
def test_with_sizes_reports_local_and_global_counts(split: str) -> None:
    ds = tf.data.Dataset.range(17).map(lambda x: x * 10).batch(8)  # batches 8, 8, 1
    for r in range(3):
        out = list(tnt_data.distribute(ds, rank=r, size=3, split=split, with_sizes=True)
                   .as_numpy_iterator())
        for (batch, sizes), total in zip(out, [8, 8, 1]):
            assert isinstance(sizes, tnt_data.StepSizes)
            assert int(sizes.total) == total
            assert int(sizes.local) == len(batch) == tnt_data.micro_batch_size(total, r, 3)


def test_index_plan_matches_distribute() -> None:
    length, gbs, size = 47, 9, 4
    ds = tf.data.Dataset.range(length).map(lambda x: x + 0).batch(gbs)
    for r in range(size):
        plan = [a.tolist() for a in tnt_data.index_plan(length, gbs, r, size)]
        assert _ids(tnt_data.distribute(ds, rank=r, size=size)) == plan
        assert _ids(tnt_data.distribute(ds, rank=r, size=size, split="after_batch")) == plan


def test_infinite_dataset() -> None:
    ds = tf.data.Dataset.range(10).map(lambda x: x * 2).repeat().batch(4)
    assert tnt_data.inspect(ds).steps_per_epoch is None
    serial = _ids(ds.take(6))
    for split in ("auto", "after_batch"):
        ranks = [tnt_data.distribute(ds, rank=r, size=3, split=split) for r in range(3)]
        assert all(int(d.cardinality()) == tf.data.INFINITE_CARDINALITY for d in ranks)
        got = [_ids(d.take(6)) for d in ranks]
        assert [got[0][k] + got[1][k] + got[2][k] for k in range(6)] == serial


def test_ragged_and_sparse_components_after_the_batch() -> None:
    ds = tf.data.Dataset.range(11).map(
        lambda x: (x, tf.ragged.range(x % 3 + 1) + x * 10, tf.sparse.from_dense(tf.fill([2], x)))
    ).batch(4)
    assert tnt_data.split_strategy(ds, size=3).mode == "after_batch"
    serial = list(ds)
    for r in range(3):
        for k, (ids, rag, sp) in enumerate(tnt_data.distribute(ds, rank=r, size=3)):
            part = tnt_data.micro_batch_slice(int(serial[k][0].shape[0]), r, 3)
            assert ids.numpy().tolist() == serial[k][0].numpy()[part].tolist()
            assert rag.to_list() == serial[k][1].to_list()[part]
            assert tf.sparse.to_dense(sp).numpy().tolist() == (
                tf.sparse.to_dense(serial[k][2]).numpy()[part].tolist())


# -- determinism and shuffle seeds --------------------------------------------------------------

def test_non_deterministic_transformations_are_made_deterministic() -> None:
    def make(det: bool) -> tf.data.Dataset:
        ds = tf.data.Dataset.range(4).interleave(
            lambda s: tf.data.Dataset.range(s, 60, 4), cycle_length=4, num_parallel_calls=4,
            deterministic=det)
        ds = ds.map(lambda x: x + 0, num_parallel_calls=4, deterministic=det)
        return ds.batch(7)

    serial = _ids(make(True))
    for split in ("auto", "after_batch"):
        ranks = _split(lambda r, s=split: tnt_data.distribute(make(False), rank=r, size=3, split=s), 3)
        assert [ranks[0][k] + ranks[1][k] + ranks[2][k] for k in range(len(serial))] == serial


def test_dataset_option_deterministic_false_is_overridden() -> None:
    opts = tf.data.Options()
    opts.deterministic = False
    ds = tf.data.Dataset.range(10).batch(3).with_options(opts)
    assert tnt_data.distribute(ds, rank=0, size=2).options().deterministic is True


def test_iterating_the_users_dataset_does_not_desynchronise_ranks() -> None:
    # distribute() rebuilds shuffles: their reshuffle state starts fresh in each result.
    def make() -> tf.data.Dataset:
        return tf.data.Dataset.range(30).shuffle(30, seed=11).batch(6)

    user = make()
    for _ in range(3):
        list(user)  # e.g. the user (or Keras) looked at the data before training
    serial = _ids(make())
    ranks = _split(lambda r: tnt_data.distribute(user, rank=r, size=2), 2)
    assert [ranks[0][k] + ranks[1][k] for k in range(5)] == serial


def test_each_unseeded_shuffle_gets_its_own_seed() -> None:
    def make(s1, s2) -> tf.data.Dataset:
        ds = tf.data.Dataset.range(24).shuffle(24, seed=s1).map(lambda x: x * 1)
        return ds.batch(4).shuffle(6, seed=s2)

    base = 77
    serial = _ids(make(base, base + 1))
    ranks = _split(lambda r: tnt_data.distribute(make(None, None), rank=r, size=2, shuffle_seed=base), 2)
    assert [ranks[0][k] + ranks[1][k] for k in range(6)] == serial
    other = _split(lambda r: tnt_data.distribute(make(None, None), rank=r, size=2, shuffle_seed=base + 5), 2)
    assert other != ranks


# -- inspect and split_strategy -------------------------------------------------------------------

def test_inspect() -> None:
    info = tnt_data.inspect(tf.data.Dataset.range(23).map(lambda x: x).batch(5).prefetch(1))
    assert info == tnt_data.PipelineInfo(True, 5, False, "batch", 5, 5)
    info = tnt_data.inspect(tf.data.Dataset.range(23).batch(5, drop_remainder=True))
    assert (info.global_batch_size, info.drop_remainder, info.steps_per_epoch) == (5, True, 4)
    info = tnt_data.inspect(tf.data.Dataset.range(23).filter(lambda x: x > 2).batch(5))
    assert (info.global_batch_size, info.steps_per_epoch) == (5, None)
    info = tnt_data.inspect(tf.data.Dataset.range(23))
    assert not info.batched and info.global_batch_size is None
    padded = tnt_data.inspect(tf.data.Dataset.range(4).map(lambda x: tf.range(x)).padded_batch(3))
    assert padded.batch_transformation == "padded_batch" and padded.steps_per_epoch == 2


def test_split_strategy_names_the_reason_for_falling_back() -> None:
    cheap = tf.data.Dataset.range(20).map(lambda x: x * 2).filter(lambda x: x > 3).batch(4)
    s = tnt_data.split_strategy(cheap, size=2)
    assert s.mode == "after_batch" and "filter" in s.reason
    assert tnt_data.split_strategy(cheap, size=1).mode == "after_batch"
    mapped = tf.data.Dataset.range(20).filter(lambda x: x > 3).map(lambda x: x * 2).batch(4)
    assert tnt_data.split_strategy(mapped, size=2).mode == "early"


def test_enumerate_and_unbatch_around_an_unseeded_shuffle() -> None:
    def make(seed) -> tf.data.Dataset:
        ds = tf.data.Dataset.range(30).batch(3).unbatch().shuffle(30, seed=seed)
        return ds.enumerate().map(lambda i, x: (i, x * 2)).batch(7)

    serial = _ids(make(tnt_data.DEFAULT_SHUFFLE_SEED), lambda e: e[1])
    for split in ("auto", "after_batch"):
        ranks = _split(lambda r, s=split: tnt_data.distribute(make(None), rank=r, size=3, split=s),
                       3, lambda e: e[1])
        assert [ranks[0][k] + ranks[1][k] + ranks[2][k] for k in range(len(serial))] == serial


def test_numpy_integers_are_accepted() -> None:
    # e.g. a seed broadcast from rank 0 arrives as a NumPy integer
    ds = tf.data.Dataset.range(12).shuffle(12)
    a = _ids(tnt_data.distribute(ds, rank=np.int64(1), size=np.int32(2), micro_batch_size=np.int64(2),
                                 shuffle_seed=np.int64(9)))
    b = _ids(tnt_data.distribute(ds, rank=1, size=2, micro_batch_size=2, shuffle_seed=9))
    assert a == b and len(a) == 3


def test_from_generator_source_with_early_split() -> None:
    def gen():
        yield from range(26)

    def make() -> tf.data.Dataset:
        ds = tf.data.Dataset.from_generator(gen, output_signature=tf.TensorSpec((), tf.int64))
        return ds.map(lambda x: (x, x * x)).batch(6)

    assert tnt_data.split_strategy(make(), size=4).mode == "early"
    serial = _ids(make(), lambda e: e[0])
    ranks = _split(lambda r: tnt_data.distribute(make(), rank=r, size=4), 4, lambda e: e[0])
    assert [[x for r in range(4) for x in ranks[r][k]] for k in range(len(serial))] == serial
    assert [len(ranks[r][-1]) for r in range(4)] == [1, 1, 0, 0]
