"""The lockstep ceiling (benchmarks/benchlib.py, issue 12) against cases computed by hand."""

from __future__ import annotations

import pytest
from benchlib import lockstep_ceiling


def test_equal_steps_lose_nothing_in_lockstep():
    assert lockstep_ceiling([[0.1, 0.1, 0.1], [0.1, 0.1, 0.1]]) == pytest.approx(1.0)


def test_alternating_slow_steps_cost_a_quarter():
    # mean step 1.5 s; in lockstep every step waits for the 2 s one: 1.5 / 2
    assert lockstep_ceiling([[1, 2, 1, 2], [2, 1, 2, 1]]) == pytest.approx(0.75)


def test_one_rank_steadily_slower_is_not_jitter_but_still_waited_for():
    # rank 1 always 3 s, rank 0 always 1 s: mean 2 s, lockstep 3 s
    assert lockstep_ceiling([[1, 1], [3, 3]]) == pytest.approx(2 / 3)


def test_ranks_with_different_step_counts_use_the_common_steps():
    assert lockstep_ceiling([[1, 2, 9], [2, 1]]) == pytest.approx(0.75)


def test_no_steps_is_an_error():
    with pytest.raises(ValueError, match="no steps"):
        lockstep_ceiling([[], [1.0]])


def test_each_round_is_divided_by_its_own_ceiling():
    from summary import over_own_ceiling

    # round 2's low ratio comes with a low ceiling: against its own ceiling it is at 1.0
    assert over_own_ceiling([0.9, 0.8, 0.95], [0.9, 0.8, 1.0]) == pytest.approx([1.0, 1.0, 0.95])


def test_rounds_without_a_ratio_are_left_out():
    from summary import over_own_ceiling

    assert over_own_ceiling([None, 0.9], [0.9, 0.9]) == pytest.approx([1.0])


def test_spread_gives_median_extremes_and_quartiles():
    from summary import spread

    got = spread([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (got["median"], got["min"], got["max"], got["q1"], got["q3"], got["n"]) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    assert spread([0.7])["q1"] == spread([0.7])["q3"] == 0.7
