"""The issue's matrix: N ranks (simulated one after the other) process the serial batches.

N in {1, 2, 3, 4, 7}, B = 5N + {0, 2}, dataset sizes 6B + {0, 2, 5}, drop_remainder
both ways, for each pipeline of pipelines.PIPELINES. One test item per (pipeline, N)
loops over the (B, size, drop) cases; the failure message names the case.

The suite runs 5 of the 12 (B, size, drop) cases per item — every B, every remainder of
the size and both drop settings appear — because each case costs up to 15 tf.data
iterators and the whole matrix took minutes of the suite. The full matrix is opt-in:
``nox -s data_matrix`` (or TNT_DATA_FULL_MATRIX=1).
"""

from __future__ import annotations

import os

import pytest
from pipelines import PIPELINES, Pipeline, check_case, rank_outputs, same_elements

import tnt_data

SIZES = [1, 2, 3, 4, 7]


FULL_MATRIX = os.environ.get("TNT_DATA_FULL_MATRIX") == "1"
#: (extra on B = 5N, extra on the size 6B, drop_remainder) of the suite's cases.
SUITE_CASES = {(0, 0, False), (0, 2, True), (2, 2, False), (2, 5, False), (2, 5, True)}


def _cases(n: int):
    for b_extra in (0, 2):
        gbs = 5 * n + b_extra
        for size_extra in (0, 2, 5):
            for drop in (False, True):
                if FULL_MATRIX or (b_extra, size_extra, drop) in SUITE_CASES:
                    yield gbs, 6 * gbs + size_extra, drop


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("p", PIPELINES, ids=lambda p: p.name)
def test_ranks_together_process_the_serial_batches(p: Pipeline, n: int) -> None:
    for gbs, length, drop in _cases(n):
        if n > 1:
            want = p.strategy
            got = tnt_data.split_strategy(p.make(length, gbs, drop, None), size=n).mode
            assert got == want, f"[{p.name}, N={n}] split='auto' chose {got}, expected {want}"
        ranks = check_case(p, n, gbs, length, drop)
        if n > 1 and p.strategy == "early":
            # the early split must give exactly what splitting after the batch gives
            after = rank_outputs(p, n, gbs, length, drop, split="after_batch")
            for r in range(n):
                assert same_elements(ranks[r], after[r]), (
                    f"[{p.name}, N={n}, B={gbs}, L={length}, drop={drop}] rank {r}: early "
                    f"split and split after the batch differ"
                )
