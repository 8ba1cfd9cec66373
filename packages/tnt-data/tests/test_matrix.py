"""The issue's matrix: N ranks (simulated one after the other) process the serial batches.

N in {1, 2, 3, 4, 7}, B = 5N + {0, 2}, dataset sizes 6B + {0, 2, 5}, drop_remainder
both ways, for each pipeline of pipelines.PIPELINES. One test item per (pipeline, N)
loops over the 12 (B, size, drop) cases; the failure message names the case.
"""

from __future__ import annotations

import pytest
from pipelines import PIPELINES, Pipeline, check_case, rank_outputs, same_elements

import tnt_data

SIZES = [1, 2, 3, 4, 7]


def _cases(n: int):
    for gbs in (5 * n, 5 * n + 2):
        for length in (6 * gbs, 6 * gbs + 2, 6 * gbs + 5):
            for drop in (False, True):
                yield gbs, length, drop


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
