"""First checks of distribute() on a common pipeline (the full matrix is in test_matrix.py)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tnt_data


def _batches(ds: tf.data.Dataset) -> list[list[int]]:
    return [np.asarray(b[0] if isinstance(b, tuple) else b).tolist() for b in ds.as_numpy_iterator()]


def test_common_pipeline_splits_each_batch_in_rank_order() -> None:
    def make() -> tf.data.Dataset:
        ds = tf.data.Dataset.range(23).map(lambda x: (x, 2 * x)).shuffle(23, seed=4)
        return ds.batch(7).prefetch(2)

    serial = _batches(make())
    ranks = [_batches(tnt_data.distribute(make(), rank=r, size=3)) for r in range(3)]
    assert [len(r) for r in ranks] == [4, 4, 4]
    for k, batch in enumerate(serial):
        assert [x for r in range(3) for x in ranks[r][k]] == batch
    # 7 = 3 + 2 + 2, and the last batch of 2 leaves rank 2 an empty micro-batch.
    assert [len(ranks[r][0]) for r in range(3)] == [3, 2, 2]
    assert [len(ranks[r][3]) for r in range(3)] == [1, 1, 0]


def test_cardinality_is_the_serial_number_of_batches() -> None:
    ds = tf.data.Dataset.range(10).batch(4)
    for r in range(3):
        assert int(tnt_data.distribute(ds, rank=r, size=3).cardinality()) == 3
