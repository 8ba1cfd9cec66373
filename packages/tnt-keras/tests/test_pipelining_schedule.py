"""Schedules as typed, printable data: action kinds, short action names, the stage x
time-slot grid and its bubble. Single process, no model: pure functions.
"""

from __future__ import annotations

import pytest

from tarantella.pipelining import (
    SCHEDULES,
    Action,
    ActionKind,
    PipelineError,
    ScheduleGrid,
    compute_order,
    schedule_grid,
)


def test_action_kinds_are_an_enum_that_compares_as_its_string():
    assert ActionKind.FORWARD == "F" and ActionKind.BACKWARD == "B" and ActionKind.SEND_ACT == "SEND_ACT"
    assert str(ActionKind.FORWARD) == "F" and f"{ActionKind.BACKWARD}" == "B"
    assert [k.value for k in ActionKind] == ["F", "B", "RECV_ACT", "SEND_ACT", "RECV_GRAD", "SEND_GRAD"]
    # A kind given as its string is stored as the enum member: equal actions, equal hashes.
    a = Action("F", 3)
    assert a.kind is ActionKind.FORWARD and a == Action(ActionKind.FORWARD, 3)
    assert hash(a) == hash(Action(ActionKind.FORWARD, 3))
    assert a.kind in ("F", "B") and a.kind == "F"
    assert repr(a) == str(a) == "F3"
    assert repr([Action("B", 0), Action("F", 12)]) == "[B0, F12]"
    assert str(Action("SEND_GRAD", 2, 1, 0)) == "SEND_GRAD(mb=2, b=1, stage=0)"
    with pytest.raises(PipelineError, match="action kind 'W' is unknown; use one of F, B, RECV_ACT"):
        Action("W", 0)


def test_gpipe_grid_two_stages_two_micro_batches():
    # Written out by hand: stage 1 starts one slot late, stage 0's backwards wait for stage 1's.
    expected = (
        "gpipe: 2 stages, 2 micro-batches, F and B one time slot each\n"
        "   slot  0  1  2  3  4  5\n"
        "stage 0 F0 F1  .  . B0 B1\n"
        "stage 1  . F0 F1 B0 B1  .\n"
        "bubble fraction: 0.333 (4 of 12 slots idle)"
    )
    assert schedule_grid("gpipe", 2, 2) == expected


def test_1f1b_grid_three_stages_four_micro_batches():
    # Written out by hand from the orders in test_gpipe_and_1f1b_orders (stage 0:
    # F0 F1 F2 B0 F3 B1 B2 B3, stage 1: F0 F1 B0 F2 B1 F3 B2 B3, stage 2: F0 B0 F1 B1 ...).
    expected = (
        "1f1b: 3 stages, 4 micro-batches, F and B one time slot each\n"
        "   slot  0  1  2  3  4  5  6  7  8  9 10 11\n"
        "stage 0 F0 F1 F2  .  . B0 F3 B1  . B2  . B3\n"
        "stage 1  . F0 F1  . B0 F2 B1 F3 B2  . B3  .\n"
        "stage 2  .  . F0 B0 F1 B1 F2 B2 F3 B3  .  .\n"
        "bubble fraction: 0.333 (12 of 36 slots idle)"
    )
    assert schedule_grid("1f1b", 3, 4) == expected


def test_one_stage_has_no_bubble_and_wide_cells_align():
    assert schedule_grid("gpipe", 1, 1).splitlines()[1:] == [
        "   slot  0  1",
        "stage 0 F0 B0",
        "bubble fraction: 0.000 (0 of 2 slots idle)",
    ]
    lines = schedule_grid("gpipe", 1, 11).splitlines()
    assert lines[0] == "gpipe: 1 stage, 11 micro-batches, F and B one time slot each"
    assert lines[2].startswith("stage 0  F0  F1") and lines[2].endswith(" B9 B10")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 13])
def test_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    grid = ScheduleGrid.simulate(schedule, p, m)
    assert grid.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert grid.num_slots == 2 * (m + p - 1)  # unit-time F and B
    assert grid.idle_slots == p * grid.num_slots - 2 * m * p
    for s in range(p):  # each stage runs its own order, one pass per slot
        assert [a for a in grid.slots[s] if a is not None] == compute_order(schedule, p, m, s)
    assert str(grid).splitlines()[-1] == (
        f"bubble fraction: {(p - 1) / (m + p - 1):.3f} ({grid.idle_slots} of {p * grid.num_slots} slots idle)")


def test_grid_respects_the_dependencies():
    grid = ScheduleGrid.simulate("1f1b", 4, 6)
    when = {(a.kind, a.micro_batch, s): t for s, row in enumerate(grid.slots) for t, a in enumerate(row) if a}
    for i in range(6):
        for s in range(1, 4):
            assert when[("F", i, s)] > when[("F", i, s - 1)]
        for s in range(3):
            assert when[("B", i, s)] > when[("B", i, s + 1)]
        assert when[("B", i, 3)] > when[("F", i, 3)]


def test_invalid_arguments_name_the_fix():
    with pytest.raises(PipelineError, match="pipeline_schedule='zigzag' is unknown; use one of gpipe, 1f1b"):
        schedule_grid("zigzag", 2, 2)
    with pytest.raises(PipelineError, match=r"num_micro_batches must be an integer >= 1, got 0; pass the number"):
        schedule_grid("1f1b", 2, 0)
    with pytest.raises(PipelineError, match=r"num_stages must be an integer >= 1, got 0; pass the number of pipeline"):
        schedule_grid("gpipe", 0, 4)
    with pytest.raises(PipelineError, match=r"num_stages must be an integer >= 1, got -1"):
        schedule_grid("gpipe", -1, 4)
    with pytest.raises(PipelineError, match=r"num_micro_batches must be an integer >= 1, got 2.0"):
        schedule_grid("gpipe", 2, 2.0)
