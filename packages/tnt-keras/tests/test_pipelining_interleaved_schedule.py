"""The interleaved 1F1B schedule (Megatron-LM virtual stages) as data: its orders, the
grid, the bubble (p - 1) / (v m) in slots, verify() and the errors that name the fix.
Single process, no model: pure functions.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tarantella.pipelining import (
    PipelineError,
    ScheduleGrid,
    actions,
    activation_bound,
    compute_order,
    peak_in_flight,
    schedule_grid,
    verify,
)
from tarantella.pipelining._schedule import check_interleaved_micro_batches


def _chunks(n: int, skip_to: int | None = None):
    """A chain of n chunks (boundary c from chunk c to c + 1); ``skip_to``: chunk 0's output
    is read by that chunk too (a skip connection)."""
    boundaries = [SimpleNamespace(producer=c, consumers=(c + 1,) + ((skip_to,) if c == 0 and skip_to
                                                                    and skip_to > 1 else ()),
                                  differentiable=True) for c in range(n - 1)]
    stages = [SimpleNamespace(inputs=tuple(b for b in range(n - 1) if c in boundaries[b].consumers),
                              outputs=(c,) if c < n - 1 else ()) for c in range(n)]
    return SimpleNamespace(num_stages=n, stages=stages, boundaries=boundaries)


def test_grid_two_stages_two_chunks_four_micro_batches():
    # Written out by hand from Megatron's rule: stage 0 warms up with 2 (p - 1) + (v - 1) p = 4
    # chunk forwards (group 0 = micro-batches 0, 1 on chunk 0, then on chunk 2), stage 1
    # with 2; then one forward, one backward; backwards in reverse chunk order.
    expected = (
        "interleaved: 2 stages x 2 virtual stages (chunk c on stage c mod 2), 4 micro-batches, "
        "F and B one time slot each (per chunk)\n"
        "   slot    0    1    2    3    4    5    6    7    8    9   10   11   12   13   14   15   16   17\n"
        "stage 0 F0c0 F1c0 F0c2 F1c2 F2c0 B0c2 F3c0 B1c2 F2c2 B0c0 F3c2 B1c0    . B2c2    . B3c2 B2c0 B3c0\n"
        "stage 1    . F0c1 F1c1 F0c3 B0c3 F1c3 B1c3 F2c1 B0c1 F3c1 B1c1 F2c3 B2c3 F3c3 B3c3 B2c1 B3c1    .\n"
        "bubble fraction: 0.111 (4 of 36 slots idle)"
    )
    assert schedule_grid("interleaved", 2, 4, virtual_stages=2) == expected


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_bubble_is_p_minus_1_over_v_m_in_slots(p, v, groups):
    m = groups * p
    grid = ScheduleGrid.simulate("interleaved", p, m, virtual_stages=v)
    # Each stage computes 2 v m chunk passes of one slot and idles 2 (p - 1) slots: the
    # (p - 1) (t_F + t_B) / v of a whole stage's passes.
    for s in range(p):
        assert sum(a is not None for a in grid.slots[s]) == 2 * v * m
        assert grid.stage_idle_slots(s) == 2 * (p - 1)
    assert grid.num_slots == 2 * v * m + 2 * (p - 1)
    assert grid.bubble_over_compute == pytest.approx((p - 1) / (v * m))
    assert grid.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    one = ScheduleGrid.simulate("1f1b", p, m)
    assert one.bubble_over_compute == pytest.approx((p - 1) / m)  # v times 1F1B's


def test_grid_respects_chunk_dependencies():
    p, v, m = 3, 2, 6
    grid = ScheduleGrid.simulate("interleaved", p, m, virtual_stages=v)
    when = {}
    for s, row in enumerate(grid.slots):
        for t, a in enumerate(row):
            if a is not None:
                assert a.chunk % p == s  # stage s holds chunks s, s + p, ...
                when[(str(a.kind), a.micro_batch, a.chunk)] = t
    n = p * v
    assert len(when) == 2 * n * m
    for i in range(m):
        for c in range(1, n):
            assert when[("F", i, c)] > when[("F", i, c - 1)]
        assert when[("B", i, n - 1)] > when[("F", i, n - 1)]
        for c in range(n - 1):
            assert when[("B", i, c)] > when[("B", i, c + 1)]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_each_chunk_runs_its_micro_batches_in_order(p, v):
    m = 2 * p
    for r in range(p):
        order = compute_order("interleaved", p, m, r, virtual_stages=v)
        assert sorted({a.chunk for a in order}) == [r + j * p for j in range(v)]
        for c in range(r, p * v, p):
            for kind in ("F", "B"):
                assert [a.micro_batch for a in order if a.chunk == c and a.kind == kind] == list(range(m))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 8, 9, 12])
def test_verify_passes(p, v, m):
    # m not a multiple of p: a batch smaller than num_micro_batches (all forwards first).
    for skip_to in (None, p * v - 1, p):  # p: chunk 0 -> chunk p, both on stage 0
        plan = _chunks(p * v, skip_to)
        lists = verify(plan, "interleaved", m, virtual_stages=v)
        verify(plan, "interleaved", m, training=False, virtual_stages=v)
        for s in range(p):
            assert lists[s] == actions(plan, "interleaved", m, s, virtual_stages=v)
            assert sum(a.kind == "F" for a in lists[s]) == v * m
            assert sum(a.kind == "B" for a in lists[s]) == v * m


def test_actions_name_chunks_and_peers():
    plan = _chunks(4)
    first = actions(plan, "interleaved", 2, 1, virtual_stages=2)[:3]
    assert [str(a) for a in first] == ["RECV_ACT(mb=0, b=0, chunk=1, peer=0)", "F0c1",
                                       "SEND_ACT(mb=0, b=1, chunk=1, peer=2)"]


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 3)])
def test_activations_stay_within_the_bound(p, v):
    m = 4 * p
    bound = activation_bound("interleaved", p, m, virtual_stages=v)
    assert bound == (v + 1) * p - 1
    peaks = [peak_in_flight(compute_order("interleaved", p, m, r, virtual_stages=v)) for r in range(p)]
    assert peaks[0] == bound and max(peaks) <= bound


def test_errors_name_the_fix():
    with pytest.raises(PipelineError, match=r"virtual_stages=2 needs pipeline_schedule='interleaved'"):
        compute_order("1f1b", 2, 4, 0, virtual_stages=2)
    with pytest.raises(PipelineError, match=r"needs virtual_stages >= 2.*pass virtual_stages=2"):
        schedule_grid("interleaved", 2, 4, virtual_stages=1)
    with pytest.raises(PipelineError, match=r"virtual_stages must be an integer >= 1, got 'two'"):
        schedule_grid("interleaved", 2, 4, virtual_stages="two")
    with pytest.raises(PipelineError, match=r"multiple of num_pipeline_stages=3.*got 4; pass "
                                            r"num_micro_batches=3 or 6"):
        check_interleaved_micro_batches(3, 4)
    check_interleaved_micro_batches(2, 4)
    with pytest.raises(PipelineError, match=r"not a multiple of virtual_stages=2"):
        verify(_chunks(3), "interleaved", 4, virtual_stages=2)
