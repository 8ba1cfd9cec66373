"""The bucket plan, one process, exact index lists written by hand (Note [Bucket rule]).

Rule: specs in order, one open bucket per dtype; a tensor joins its dtype's open bucket
unless the bucket would then exceed the threshold (then it closes and the tensor starts
a new one); threshold 0 = one tensor per bucket; buckets ordered by first index.
"""

from __future__ import annotations

import numpy as np
import pytest

import tnt_comm as t

# The issue's case: float32 tensors of 94, 17, 2, 81 elements = 376, 68, 8, 324 bytes.
ISSUE_SPECS = [t.TensorSpec(f"t{i}", n, "float32") for i, n in enumerate([94, 17, 2, 81])]


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [
        (0, [[0], [1], [2], [3]]),  # no fusion
        (8, [[0], [1], [2], [3]]),  # only t2 (8 B) fits, and alone
        (40, [[0], [1], [2], [3]]),  # 68 + 8 = 76 > 40
        (400, [[0], [1, 2, 3]]),  # 376 + 68 > 400; 68 + 8 + 324 = 400 fits exactly
        (448, [[0, 1], [2, 3]]),  # 376 + 68 = 444; + 8 = 452 > 448
        (800, [[0, 1, 2, 3]]),  # 776 bytes in all
    ],
)
def test_issue_table(threshold: int, expected: list[list[int]]) -> None:
    assert t.plan_buckets(ISSUE_SPECS, threshold) == expected


def test_dtypes_never_mix_and_buckets_sorted_by_first_index() -> None:
    specs = [
        t.TensorSpec("a", 10, "float32"),  # 40 B
        t.TensorSpec("b", 10, "float64"),  # 80 B
        t.TensorSpec("c", 10, "float32"),  # 40 B
        t.TensorSpec("d", 20, "float64"),  # 160 B: 80 + 160 > 200 -> new bucket
        t.TensorSpec("e", 5, np.float16),  # 10 B
        t.TensorSpec("f", 30, "float32"),  # 120 B: 40 + 40 + 120 = 200 fits
    ]
    assert t.plan_buckets(specs, 200) == [[0, 2, 5], [1], [3], [4]]
    assert t.plan_buckets(specs, 10**9) == [[0, 2, 5], [1, 3], [4]]


def test_zero_length_and_oversized_tensors() -> None:
    specs = [t.TensorSpec(f"z{i}", n, "int64") for i, n in enumerate([0, 0, 100, 0, 1])]
    assert t.plan_buckets(specs, 0) == [[0], [1], [2], [3], [4]]
    assert t.plan_buckets(specs, 16) == [[0, 1], [2], [3, 4]]  # 800 B tensor alone


def test_empty_and_bad_arguments() -> None:
    assert t.plan_buckets([], 100) == []
    with pytest.raises(ValueError, match="threshold_bytes must be >= 0"):
        t.plan_buckets(ISSUE_SPECS, -1)
    with pytest.raises(TypeError, match=r"specs\[0\] is a tuple"):
        t.plan_buckets([("a", 1, "float32")], 0)  # type: ignore[list-item]


def test_plan_is_pure() -> None:
    first = t.plan_buckets(ISSUE_SPECS, 448)
    assert all(t.plan_buckets(ISSUE_SPECS, 448) == first for _ in range(3))
