"""The early split really saves work: each rank maps about 1/N of the samples."""

from __future__ import annotations

from collections import Counter

import numpy as np
import tensorflow as tf

import tnt_data

LENGTH, GBS = 103, 10  # batches of 10 x 10 and a last one of 3


def _counted_pipeline(calls: Counter, tag: object) -> tf.data.Dataset:
    def bump(x: tf.Tensor) -> tf.Tensor:
        calls[tag] += 1
        return x

    def expensive(x: tf.Tensor) -> tf.Tensor:
        y = tf.py_function(bump, [x], tf.int64)
        y.set_shape([])
        return y * 2

    ds = tf.data.Dataset.range(LENGTH).shuffle(LENGTH, seed=5)
    return ds.map(expensive, num_parallel_calls=2).batch(GBS).prefetch(1)


def test_early_split_maps_only_each_ranks_samples() -> None:
    calls: Counter = Counter()
    serial = list(_counted_pipeline(calls, "serial").as_numpy_iterator())
    assert calls["serial"] == LENGTH
    batch_sizes = [len(b) for b in serial]
    for size in (2, 4):
        for r in range(size):
            for split in ("auto", "after_batch"):
                ds = tnt_data.distribute(_counted_pipeline(calls, (size, r, split)), rank=r, size=size,
                                         split=split)
                out = list(ds.as_numpy_iterator())
                assert [b.tolist() for b in out] == [
                    np.array_split(b, size)[r].tolist() for b in serial
                ]
            mine = sum(len(np.array_split(np.arange(b), size)[r]) for b in batch_sizes)
            # a rank whose slice of the last batch (3 samples) is empty maps one placeholder
            placeholder = 1 if r >= batch_sizes[-1] else 0
            assert calls[(size, r, "auto")] == mine + placeholder, (size, r, calls)
            assert calls[(size, r, "after_batch")] == LENGTH
        total = sum(calls[(size, r, "auto")] for r in range(size))
        assert total <= LENGTH + size  # together the ranks map each sample about once
