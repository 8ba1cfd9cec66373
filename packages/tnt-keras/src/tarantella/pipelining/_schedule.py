"""Pipeline schedules: the explicit, deterministic list of actions of each stage.

A schedule orders a stage's forward (F) and backward (B) passes over the m micro-batches
of a step; :func:`actions` expands that order with the receives before and the sends
after each pass, for the boundaries of a plan. Both schedules run the backward passes of
each stage in micro-batch order 0..m-1, so gradients accumulate in the same order
whatever the schedule (GPipe and 1F1B give bitwise-identical results).

- ``gpipe``: all forwards, then all backwards. Stage s holds m micro-batches' activations.
- ``1f1b``: ``min(p - s - 1, m)`` warm-up forwards, then alternate one forward and one
  backward, then the remaining backwards. Stage s holds at most ``min(p - s, m)``.

Both have the same bubble, (p - 1) / (m + p - 1) of a step. Sends are non-blocking and
receives blocking, which makes both schedules deadlock-free (tests run them).
:func:`schedule_grid` prints a schedule as a stage x time-slot grid with its bubble.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .._core.errors import PipelineError

SCHEDULES = ("gpipe", "1f1b")


class ActionKind(str, enum.Enum):
    """What an :class:`Action` does. The value is its printable form (``F``, ``B``,
    ``RECV_ACT`` ...); a member is a ``str`` and equals its value (``ActionKind.FORWARD == "F"``).
    """

    FORWARD = "F"
    BACKWARD = "B"
    RECV_ACT = "RECV_ACT"
    SEND_ACT = "SEND_ACT"
    RECV_GRAD = "RECV_GRAD"
    SEND_GRAD = "SEND_GRAD"

    def __str__(self) -> str:
        return self.value


_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)


@dataclass(frozen=True, repr=False)
class Action:
    """One step of a stage: ``kind`` an :class:`ActionKind` (or its value, ``"F"``, ``"B"`` ...).

    ``boundary`` and ``peer`` (a stage index) are set for communication actions. Printed
    short: ``F3`` is the forward pass of micro-batch 3, ``SEND_ACT(mb=3, b=0, stage=1)``
    sends boundary 0 of micro-batch 3 to stage 1.
    """

    kind: ActionKind
    micro_batch: int
    boundary: int = -1
    peer: int = -1

    def __post_init__(self) -> None:
        try:
            kind = ActionKind(self.kind)
        except ValueError:
            raise PipelineError(f"action kind {self.kind!r} is unknown; use one of "
                                f"{', '.join(k.value for k in ActionKind)}.") from None
        object.__setattr__(self, "kind", kind)

    def __str__(self) -> str:
        if self.kind in _COMPUTE:
            return f"{self.kind}{self.micro_batch}"
        return f"{self.kind}(mb={self.micro_batch}, b={self.boundary}, stage={self.peer})"

    __repr__ = __str__


def check_schedule(name: str) -> str:
    """``name`` if it is a known schedule, else a PipelineError listing them."""
    if name not in SCHEDULES:
        raise PipelineError(f"pipeline_schedule={name!r} is unknown; use one of {', '.join(SCHEDULES)}.")
    return name


def compute_order(schedule: str, num_stages: int, num_micro_batches: int, stage: int,
                  training: bool = True) -> list[Action]:
    """The F/B order of ``stage``; forward-only (evaluate, predict) when not ``training``."""
    check_schedule(schedule)
    p, m, s = num_stages, num_micro_batches, stage
    if not 0 <= s < p:
        raise PipelineError(f"stage {s} is not in 0..{p - 1}")
    if m < 0:
        raise PipelineError(f"number of micro-batches must be >= 0, got {m}")
    forwards = [Action(ActionKind.FORWARD, i) for i in range(m)]
    backwards = [Action(ActionKind.BACKWARD, i) for i in range(m)]
    if not training:
        return forwards
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(p - s - 1, m)
    order = forwards[:warmup]
    for i in range(warmup, m):
        order += [forwards[i], backwards[i - warmup]]
    order += backwards[m - warmup:] if warmup else []
    return order


def peak_in_flight(order: list[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once under ``order``."""
    live = peak = 0
    for a in order:
        if a.kind is ActionKind.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind is ActionKind.BACKWARD:
            live -= 1
    return peak


def actions(plan, schedule: str, num_micro_batches: int, stage: int, training: bool = True) -> list[Action]:
    """``compute_order`` with the receives and sends of ``plan``'s boundaries around it.

    Receives and sends of one micro-batch run in boundary order, per peer, so messages
    between two stages arrive in the order they were sent.
    """
    st = plan.stages[stage]
    out: list[Action] = []
    for a in compute_order(schedule, plan.num_stages, num_micro_batches, stage, training):
        i = a.micro_batch
        if a.kind is ActionKind.FORWARD:
            for b in st.inputs:
                out.append(Action(ActionKind.RECV_ACT, i, b, plan.boundaries[b].producer))
            out.append(a)
            for b in st.outputs:
                for c in plan.boundaries[b].consumers:
                    out.append(Action(ActionKind.SEND_ACT, i, b, c))
        else:
            for b in st.outputs:
                if plan.boundaries[b].differentiable:
                    for c in plan.boundaries[b].consumers:
                        out.append(Action(ActionKind.RECV_GRAD, i, b, c))
            out.append(a)
            for b in st.inputs:
                if plan.boundaries[b].differentiable:
                    out.append(Action(ActionKind.SEND_GRAD, i, b, plan.boundaries[b].producer))
    return out


def micro_batch_sizes(batch: int, num_micro_batches: int) -> list[int]:
    """Sizes of the micro-batches of a batch: differ by <= 1, larger first, none empty.

    A batch smaller than ``num_micro_batches`` runs as ``batch`` micro-batches of one
    sample (an empty batch as none): no sample is dropped, no micro-batch is empty.
    """
    if num_micro_batches < 1:
        raise PipelineError(f"num_micro_batches must be >= 1, got {num_micro_batches}.")
    m = min(num_micro_batches, batch)
    if m == 0:
        return []
    base, extra = divmod(batch, m)
    return [base + 1 if i < extra else base for i in range(m)]


def _check_count(name: str, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipelineError(f"{name} must be an integer >= 1, got {value!r}; pass {what}.")
    return value


@dataclass(frozen=True)
class ScheduleGrid:
    """A schedule run in unit time: what each stage does in each time slot of one step.

    ``slots[s][t]`` is the :class:`Action` (``F`` or ``B``) that stage ``s`` runs in slot
    ``t``, or ``None`` where it idles. Every forward and backward pass takes one slot; a
    stage runs its passes in its :func:`compute_order` as soon as their inputs are there:
    forward ``i`` on stage ``s`` after forward ``i`` on stage ``s - 1``, backward ``i``
    after backward ``i`` on stage ``s + 1`` (on the last stage, after its forward ``i``).
    Communication takes no time. ``str()`` prints the grid, one row per stage, and the
    bubble as its last line. Build one with :meth:`simulate`.
    """

    schedule: str
    num_stages: int
    num_micro_batches: int
    slots: tuple[tuple[Action | None, ...], ...]

    @classmethod
    def simulate(cls, schedule: str, num_stages: int, num_micro_batches: int) -> ScheduleGrid:
        """The grid of a training step of ``schedule`` with ``num_stages`` stages and
        ``num_micro_batches`` micro-batches; a PipelineError for an unknown schedule or a
        count below 1."""
        check_schedule(schedule)
        p = _check_count("num_stages", num_stages, "the number of pipeline stages (num_pipeline_stages)")
        m = _check_count("num_micro_batches", num_micro_batches,
                         "the number of micro-batches a step is cut into")
        orders = [compute_order(schedule, p, m, s) for s in range(p)]
        done: set[tuple[ActionKind, int, int]] = set()  # (kind, micro-batch, stage) of earlier slots
        nxt = [0] * p
        rows: list[list[Action | None]] = [[] for _ in range(p)]
        while any(nxt[s] < len(orders[s]) for s in range(p)):
            ran = []
            for s in range(p):
                a = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
                if a is not None:
                    if a.kind is ActionKind.FORWARD:
                        needs = (a.kind, a.micro_batch, s - 1) if s > 0 else None
                    elif s < p - 1:
                        needs = (a.kind, a.micro_batch, s + 1)
                    else:
                        needs = (ActionKind.FORWARD, a.micro_batch, s)
                    if needs is not None and needs not in done:
                        a = None
                rows[s].append(a)
                if a is not None:
                    ran.append((a.kind, a.micro_batch, s))
            if not ran:  # cannot happen for the schedules of compute_order
                raise PipelineError(f"schedule {schedule!r} deadlocks after {len(rows[0]) - 1} slots")
            done.update(ran)
            for _, _, s in ran:
                nxt[s] += 1
        return cls(schedule, p, m, tuple(tuple(r) for r in rows))

    @property
    def num_slots(self) -> int:
        """Time slots of the step, from the first stage's first forward to the last pass."""
        return len(self.slots[0])

    @property
    def idle_slots(self) -> int:
        """Slots, summed over the stages, in which a stage idles."""
        return sum(a is None for row in self.slots for a in row)

    @property
    def bubble_fraction(self) -> float:
        """Idle slots / all slots (``num_stages * num_slots``): (p - 1) / (m + p - 1) for both
        schedules."""
        return self.idle_slots / (self.num_stages * self.num_slots)

    def __str__(self) -> str:
        p, n = self.num_stages, self.num_slots
        cells = [[str(a) if a is not None else "." for a in row] for row in self.slots]
        width = max(len(str(n - 1)), *(len(c) for row in cells for c in row))
        label = len(f"stage {p - 1}")
        m = self.num_micro_batches
        lines = [f"{self.schedule}: {p} stage{'s' * (p != 1)}, {m} micro-batch{'es' * (m != 1)}, "
                 "F and B one time slot each",
                 " ".join(["slot".rjust(label)] + [str(t).rjust(width) for t in range(n)])]
        lines += [" ".join([f"stage {s}".rjust(label)] + [c.rjust(width) for c in row])
                  for s, row in enumerate(cells)]
        lines.append(f"bubble fraction: {self.bubble_fraction:.3f} "
                     f"({self.idle_slots} of {p * n} slots idle)")
        return "\n".join(lines)


def schedule_grid(schedule: str, num_stages: int, num_micro_batches: int) -> str:
    """``schedule`` (``"gpipe"`` or ``"1f1b"``) printed as a stage x time-slot grid.

    One row per stage, one column per time slot of a training step with unit-time forward
    and backward passes (see :class:`ScheduleGrid`); a cell is the pass that stage runs
    then (``F3``: forward of micro-batch 3, ``B3`` its backward) or ``.`` where it idles.
    The last line is the bubble: idle slots / all slots. A pure function (no model, no TensorFlow).

        print(tnt.pipelining.schedule_grid("1f1b", 4, 8))

    Raises PipelineError for an unknown schedule or a count below 1.
    """
    return str(ScheduleGrid.simulate(schedule, num_stages, num_micro_batches))
