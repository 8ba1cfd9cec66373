"""Schedules as typed, printable data: action kinds, short action names, the stage x
time-slot grid and its bubble. Single process, no model: pure functions.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tarantella.pipelining import (
    INTERLEAVED,
    SCHEDULES,
    Action,
    ActionKind,
    PipelineError,
    ScheduleGrid,
    _schedule,
    actions,
    activation_bound,
    compute_order,
    peak_in_flight,
    schedule_grid,
    verify,
)


def test_action_kinds_are_an_enum_that_compares_as_its_string():
    assert ActionKind.FORWARD == "F" and ActionKind.BACKWARD == "B" and ActionKind.SEND_ACT == "SEND_ACT"
    assert str(ActionKind.FORWARD) == "F" and f"{ActionKind.BACKWARD}" == "B"
    assert [k.value for k in ActionKind] == ["F", "B", "RECV_ACT", "SEND_ACT", "RECV_GRAD", "SEND_GRAD", "W"]
    # A kind given as its string is stored as the enum member: equal actions, equal hashes.
    a = Action("F", 3)
    assert a.kind is ActionKind.FORWARD and a == Action(ActionKind.FORWARD, 3)
    assert hash(a) == hash(Action(ActionKind.FORWARD, 3))
    assert a.kind in ("F", "B") and a.kind == "F"
    assert repr(a) == str(a) == "F3"
    assert repr([Action("B", 0), Action("F", 12)]) == "[B0, F12]"
    assert str(Action("SEND_GRAD", 2, 1, 0)) == "SEND_GRAD(mb=2, b=1, stage=0)"
    assert str(Action("W", 4)) == "W4" and Action("W", 4).kind is ActionKind.WEIGHT
    with pytest.raises(PipelineError, match="action kind 'X' is unknown; use one of F, B, RECV_ACT"):
        Action("X", 0)


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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
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
    with pytest.raises(PipelineError, match="pipeline_schedule='zigzag' is unknown; use one of gpipe, 1f1b, zb-h1"):
        schedule_grid("zigzag", 2, 2)
    with pytest.raises(PipelineError, match=r"num_micro_batches must be an integer >= 1, got 0; pass the number"):
        schedule_grid("1f1b", 2, 0)
    with pytest.raises(PipelineError, match=r"num_stages must be an integer >= 1, got 0; pass the number of pipeline"):
        schedule_grid("gpipe", 0, 4)
    with pytest.raises(PipelineError, match=r"num_stages must be an integer >= 1, got -1"):
        schedule_grid("gpipe", -1, 4)
    with pytest.raises(PipelineError, match=r"num_micro_batches must be an integer >= 1, got 2.0"):
        schedule_grid("gpipe", 2, 2.0)


# -- ZB-H1 ---------------------------------------------------------------------------------------
def test_zb_h1_grid_two_stages_four_micro_batches():
    # Written out by hand: 1F1B's F/B order; stage 1 defers one W (W0 after B1), stage 0 none;
    # stage 0 idles once (waiting for B0), stage 1 once (waiting for F0).
    expected = (
        "zb-h1: 2 stages, 4 micro-batches, F, B and W one time slot each\n"
        "   slot  0  1  2  3  4  5  6  7  8  9 10 11 12\n"
        "stage 0 F0 F1  . B0 W0 F2 B1 W1 F3 B2 W2 B3 W3\n"
        "stage 1  . F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3\n"
        "bubble fraction: 0.077 (2 of 26 slots idle)"
    )
    assert schedule_grid("zb-h1", 2, 4) == expected


def test_1f1b_grid_with_a_two_slot_backward():
    # The same work as ZB-H1's B + W in one pass: 1F1B idles 3 (p - 1) slots per stage.
    expected = (
        "1f1b: 2 stages, 4 micro-batches, F 1 slot, B 2 slots\n"
        "   slot  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14\n"
        "stage 0 F0 F1  .  . B0 B0 F2 B1 B1 F3 B2 B2  . B3 B3\n"
        "stage 1  . F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3  .  .\n"
        "bubble fraction: 0.200 (6 of 30 slots idle)"
    )
    assert schedule_grid("1f1b", 2, 4, durations={"B": 2}) == expected


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 13])
def test_zb_h1_idles_a_third_of_1f1b_at_the_same_peak_memory(p, m):
    zb = ScheduleGrid.simulate("zb-h1", p, m)
    ref = ScheduleGrid.simulate("1f1b", p, m, durations={"B": 2})  # B + W as one pass
    for s in range(p):
        # m >= p: p - 1 idle slots against 1F1B's 3 (p - 1); fewer micro-batches than
        # stages leave p - m more slots with nothing to run.
        assert zb.stage_idle_slots(s) == p - 1 + max(0, p - m)
        assert ref.stage_idle_slots(s) == 3 * (p - 1)
        order = compute_order("zb-h1", p, m, s)
        for kind in ("F", "B", "W"):  # each pass once per micro-batch, in micro-batch order
            assert [a.micro_batch for a in order if a.kind == kind] == list(range(m))
        for i in range(m):
            assert order.index(Action("F", i)) < order.index(Action("B", i)) < order.index(Action("W", i))
        # F/B as 1F1B's; activations live until W, at most 1F1B's stage-0 peak min(p, m)
        assert [a for a in order if a.kind != "W"] == compute_order("1f1b", p, m, s)
        assert peak_in_flight(order) <= min(p, m) == activation_bound("zb-h1", p, m)
    assert max(peak_in_flight(compute_order("zb-h1", p, m, s)) for s in range(p)) == \
        max(peak_in_flight(compute_order("1f1b", p, m, s)) for s in range(p))


def test_forward_only_has_no_backward_passes():
    assert compute_order("zb-h1", 3, 4, 1, training=False) == [Action("F", i) for i in range(4)]


def test_durations_are_checked():
    with pytest.raises(PipelineError, match=r"durations: 'X' is not a pass; use F, B or W"):
        schedule_grid("1f1b", 2, 2, durations={"X": 1})
    with pytest.raises(PipelineError, match=r"durations\['B'\] must be an integer >= 1, got 0"):
        schedule_grid("1f1b", 2, 2, durations={"B": 0})


# -- verify: the schedules run against each other before they run for real -----------------------
def _plan(p: int, skip: bool = False, frozen: int | None = None):
    """A plan's shape without a model: a chain of p stages (boundary s from stage s to s + 1),
    with ``skip`` stage 0's output also read by the last stage, ``frozen`` a boundary
    without gradient (an integer tensor)."""
    boundaries = [SimpleNamespace(producer=s, consumers=(s + 1,) + ((p - 1,) if skip and s == 0 and p > 2 else ()),
                                  differentiable=s != frozen) for s in range(p - 1)]
    stages = [SimpleNamespace(inputs=tuple(b for b in range(p - 1) if s in boundaries[b].consumers),
                              outputs=(s,) if s < p - 1 else ()) for s in range(p)]
    return SimpleNamespace(num_stages=p, stages=stages, boundaries=boundaries)


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s not in INTERLEAVED])  # its own file
@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 8), (3, 4), (4, 2), (4, 9)])
@pytest.mark.parametrize("skip", [False, True])
def test_verify_passes_every_schedule(schedule, p, m, skip):
    plan = _plan(p, skip)
    lists = verify(plan, schedule, m)
    for s in range(p):
        assert lists[s] == actions(plan, schedule, m, s)
        if schedule == "zb-h1":  # W passes send and receive nothing
            assert sum(a.kind == "W" for a in lists[s]) == m
    verify(plan, schedule, m, training=False)
    verify(_plan(p, skip, frozen=0), schedule, m)


def test_verify_finds_a_send_without_its_receive():
    plan = _plan(3)
    plan.boundaries[0].consumers = (1, 2)  # stage 2 does not read boundary 0
    with pytest.raises(PipelineError, match=r"stage 0 sends 1 and stage 2 receives 0 act message\(s\) "
                                            r"of micro-batch 0, boundary 0"):
        verify(plan, "zb-h1", 2)


def test_verify_finds_a_deadlock(monkeypatch):
    real = _schedule.compute_order

    def crossed(schedule, p, m, s, training=True):  # stage 0 waits for B0 before sending F1
        if s == 0 and training:
            return [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]
        return real("gpipe", p, m, s, training)

    monkeypatch.setattr(_schedule, "compute_order", crossed)
    with pytest.raises(PipelineError, match=r"'1f1b' with 2 micro-batches deadlocks: stage 0 at "
                                            r"RECV_GRAD\(mb=0, b=0, stage=1\); stage 1 at RECV_ACT\(mb=1"):
        verify(_plan(2), "1f1b", 2)


def test_verify_finds_activations_above_the_bound(monkeypatch):
    real = _schedule.compute_order
    monkeypatch.setattr(_schedule, "compute_order",
                        lambda schedule, p, m, s, training=True: real("gpipe", p, m, s, training))
    assert activation_bound("gpipe", 2, 4) == 4 and activation_bound("1f1b", 2, 4) == 2
    with pytest.raises(PipelineError, match=r"'zb-h1': stage 0 holds 4 micro-batches' activations, above the bound 2"):
        verify(_plan(2), "zb-h1", 4)
