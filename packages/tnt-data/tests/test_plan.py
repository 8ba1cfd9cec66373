"""The framework-free split rule and index plan (no TensorFlow needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tnt_data


@pytest.mark.parametrize(
    ("batch", "size", "sizes"),
    [(10, 3, [4, 3, 3]), (2, 3, [1, 1, 0]), (0, 2, [0, 0]), (7, 7, [1] * 7), (5, 1, [5]),
     (37, 7, [6, 6, 5, 5, 5, 5, 5])],
)
def test_micro_batch_sizes_table(batch: int, size: int, sizes: list[int]) -> None:
    assert tnt_data.micro_batch_sizes(batch, size) == sizes
    slices = [tnt_data.micro_batch_slice(batch, r, size) for r in range(size)]
    assert [s.stop - s.start for s in slices] == sizes
    assert [s.start for s in slices] == [sum(sizes[:r]) for r in range(size)]


def test_index_plan_table() -> None:
    # 11 samples, global batch 4, 3 ranks: batches [0..3], [4..7], [8..10]
    plans = [[a.tolist() for a in tnt_data.index_plan(11, 4, r, 3)] for r in range(3)]
    assert plans == [[[0, 1], [4, 5], [8]], [[2], [6], [9]], [[3], [7], [10]]]
    dropped = [[a.tolist() for a in tnt_data.index_plan(11, 4, r, 3, drop_remainder=True)] for r in range(3)]
    assert dropped == [[[0, 1], [4, 5]], [[2], [6]], [[3], [7]]]
    # a last batch smaller than the number of ranks: rank 2 gets an empty step, not no step
    assert [a.tolist() for a in tnt_data.index_plan(6, 4, 2, 3)] == [[3], []]


@settings(max_examples=300, deadline=None)
@given(
    length=st.integers(0, 400),
    gbs=st.integers(1, 50),
    size=st.integers(1, 12),
    drop=st.booleans(),
)
def test_index_plan_properties(length: int, gbs: int, size: int, drop: bool) -> None:
    plans = [tnt_data.index_plan(length, gbs, r, size, drop_remainder=drop) for r in range(size)]
    steps = length // gbs if drop else -(-length // gbs)
    assert all(len(p) == steps for p in plans), "every rank takes the same number of steps"
    for k in range(steps):
        serial = np.arange(k * gbs, min((k + 1) * gbs, length))
        parts = [plans[r][k] for r in range(size)]
        # independent oracle: numpy's array_split gives the first len % size parts one extra
        for got, want in zip(parts, np.array_split(serial, size)):
            assert got.dtype == np.int64
            assert got.tolist() == want.tolist()
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
    covered = np.concatenate([a for p in plans for a in p]) if steps else np.zeros(0)
    assert sorted(covered.tolist()) == list(range(steps * gbs if drop else length))


@given(batch=st.integers(0, 1000), size=st.integers(1, 64))
def test_micro_batch_sizes_sum_and_order(batch: int, size: int) -> None:
    sizes = tnt_data.micro_batch_sizes(batch, size)
    assert sum(sizes) == batch
    assert sizes == sorted(sizes, reverse=True)
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: tnt_data.micro_batch_sizes(4, 0), "size must be >= 1"),
        (lambda: tnt_data.micro_batch_slice(4, 3, 3), "rank must be in [0, size)"),
        (lambda: tnt_data.micro_batch_slice(4, -1, 3), "rank must be in [0, size)"),
        (lambda: tnt_data.micro_batch_size(4, 1.0, 3), "rank must be an int"),
        (lambda: tnt_data.micro_batch_sizes(-1, 2), "global_batch_size must be >= 0"),
        (lambda: tnt_data.index_plan(10, 0, 0, 1), "global_batch_size must be >= 1"),
        (lambda: tnt_data.index_plan(-3, 2, 0, 1), "length must be an int >= 0"),
    ],
)
def test_plan_errors_name_the_problem(call, words: str) -> None:
    with pytest.raises(tnt_data.DistributionError, match=None) as info:
        call()
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_the_plan_does_not_import_tensorflow() -> None:
    # NumPy/PyTorch users get the index plan without paying TensorFlow's import.
    import subprocess
    import sys

    code = ("import sys, tnt_data; p = tnt_data.index_plan(11, 4, 2, 3); "
            "assert [a.tolist() for a in p] == [[3], [7], [10]]; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
