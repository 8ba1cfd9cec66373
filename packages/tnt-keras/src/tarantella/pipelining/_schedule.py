"""Pipeline schedules: the explicit, deterministic list of actions of each stage.

A schedule orders a stage's forward (F) and backward passes over the m micro-batches of
a step; :func:`actions` expands that order with the receives before and the sends after
each pass, for the boundaries of a plan. Every schedule runs the weight-gradient passes
of each stage in micro-batch order 0..m-1, so gradients accumulate in the same order
whatever the schedule (GPipe, 1F1B and ZB-H1 give bitwise-identical results).

- ``gpipe``: all forwards, then all backwards. Stage s holds m micro-batches' activations.
- ``1f1b``: ``min(p - s - 1, m)`` warm-up forwards, then alternate one forward and one
  backward, then the remaining backwards. Stage s holds at most ``min(p - s, m)``.
- ``zb-h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward is
  split into B (the gradient with respect to the stage's inputs, sent upstream at once)
  and W (the gradient with respect to its weights). The order of F and B is 1F1B's;
  stage s defers up to s W passes and runs them where it would otherwise wait. A
  micro-batch's activations live until its W, so stage s holds at most
  ``min(p - s, m) + s <= min(p, m)``: 1F1B's bound (its stage 0's).

GPipe and 1F1B idle (p - 1) / (m + p - 1) of a step; with F, B and W of equal time, ZB-H1
idles p - 1 slots per stage where 1F1B (B + W as one pass of two slots) idles 3 (p - 1).
Sends are non-blocking and receives blocking; :func:`verify` runs every stage's action
list against the others (every send has its receive, no deadlock, activations within
1F1B's bound) and the executor runs it once per step shape before the first step.
:func:`schedule_grid` prints a schedule as a stage x time-slot grid with its bubble.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .._core.errors import PipelineError

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
#: The schedules that split the backward pass into B (inputs) and W (weights).
SPLIT_BACKWARD = ("zb-h1",)


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
    WEIGHT = "W"  # the weight gradients of a micro-batch whose B ran earlier (ZB-H1)

    def __str__(self) -> str:
        return self.value


_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT)


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
    """The F/B(/W) order of ``stage``; forward-only (evaluate, predict) when not ``training``."""
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
    if schedule == "1f1b":
        for i in range(warmup, m):
            order += [forwards[i], backwards[i - warmup]]
        order += backwards[m - warmup:] if warmup else []
        return order
    # zb-h1: 1F1B's F and B; W of micro-batch j after B(j), at most s of them deferred.
    deferred: list[int] = []

    def backward(j: int) -> None:
        order.append(backwards[j])
        deferred.append(j)
        while len(deferred) > s:
            order.append(Action(ActionKind.WEIGHT, deferred.pop(0)))

    for i in range(warmup, m):
        order.append(forwards[i])
        backward(i - warmup)
    for j in range(m - warmup, m):
        backward(j)
    order += [Action(ActionKind.WEIGHT, j) for j in deferred]
    return order


def peak_in_flight(order: list[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once under ``order``
    (from F until B, or until W where the order splits the backward)."""
    release = ActionKind.WEIGHT if any(a.kind is ActionKind.WEIGHT for a in order) else ActionKind.BACKWARD
    live = peak = 0
    for a in order:
        if a.kind is ActionKind.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind is release:
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
        if a.kind is ActionKind.WEIGHT:
            out.append(a)
        elif a.kind is ActionKind.FORWARD:
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


def _depends_on(a: Action, stage: int, num_stages: int) -> tuple[ActionKind, int, int] | None:
    """The (kind, micro-batch, stage) pass that must end before ``a`` on ``stage`` starts."""
    if a.kind is ActionKind.FORWARD:
        return (ActionKind.FORWARD, a.micro_batch, stage - 1) if stage > 0 else None
    if a.kind is ActionKind.WEIGHT:
        return (ActionKind.BACKWARD, a.micro_batch, stage)
    if stage < num_stages - 1:
        return (ActionKind.BACKWARD, a.micro_batch, stage + 1)
    return (ActionKind.FORWARD, a.micro_batch, stage)


def _durations(schedule: str, durations: dict | None) -> dict[ActionKind, int]:
    out = {ActionKind.FORWARD: 1, ActionKind.BACKWARD: 1, ActionKind.WEIGHT: 1}
    for key, value in (durations or {}).items():
        try:
            kind = ActionKind(key)
        except ValueError:
            kind = None
        if kind not in out:
            raise PipelineError(f"durations: {key!r} is not a pass; use F, B or W.")
        out[kind] = _check_count(f"durations[{key!r}]", value, "a whole number of time slots")
    return out


@dataclass(frozen=True)
class ScheduleGrid:
    """A schedule run in unit time: what each stage does in each time slot of one step.

    ``slots[s][t]`` is the :class:`Action` (``F``, ``B`` or ``W``) that stage ``s`` runs
    in slot ``t``, or ``None`` where it idles. A pass takes ``durations[kind]`` slots (one
    each unless given); a stage runs its passes in its :func:`compute_order` as soon as
    their inputs are there: forward ``i`` on stage ``s`` after forward ``i`` on stage
    ``s - 1``, backward ``i`` after backward ``i`` on stage ``s + 1`` (on the last stage,
    after its forward ``i``), W ``i`` after B ``i`` on the same stage. Communication takes
    no time. ``str()`` prints the grid, one row per stage, and the bubble as its last
    line. Build one with :meth:`simulate`.
    """

    schedule: str
    num_stages: int
    num_micro_batches: int
    slots: tuple[tuple[Action | None, ...], ...]
    durations: tuple[tuple[str, int], ...] = (("F", 1), ("B", 1), ("W", 1))

    @classmethod
    def simulate(cls, schedule: str, num_stages: int, num_micro_batches: int,
                 durations: dict | None = None) -> ScheduleGrid:
        """The grid of a training step of ``schedule`` with ``num_stages`` stages and
        ``num_micro_batches`` micro-batches; ``durations`` maps ``"F"``, ``"B"``, ``"W"`` to
        slots (``{"B": 2}`` gives 1F1B's joint backward the time of ZB-H1's B + W). A
        PipelineError for an unknown schedule, a count below 1 or a deadlock."""
        check_schedule(schedule)
        p = _check_count("num_stages", num_stages, "the number of pipeline stages (num_pipeline_stages)")
        m = _check_count("num_micro_batches", num_micro_batches,
                         "the number of micro-batches a step is cut into")
        cost = _durations(schedule, durations)
        orders = [compute_order(schedule, p, m, s) for s in range(p)]
        ends: dict[tuple[ActionKind, int, int], int] = {}  # pass -> the slot after its last
        nxt = [0] * p
        busy_until = [0] * p
        rows: list[list[Action | None]] = [[] for _ in range(p)]
        t = 0
        while any(nxt[s] < len(orders[s]) for s in range(p)) or any(b > t for b in busy_until):
            ran = False
            for s in range(p):
                if busy_until[s] > t:
                    rows[s].append(rows[s][-1])
                    ran = True
                    continue
                a = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
                if a is not None:
                    needs = _depends_on(a, s, p)
                    if needs is not None and ends.get(needs, t + 1) > t:
                        a = None
                rows[s].append(a)
                if a is not None:
                    ran = True
                    nxt[s] += 1
                    busy_until[s] = t + cost[a.kind]
                    ends[(a.kind, a.micro_batch, s)] = busy_until[s]
            if not ran:  # cannot happen for the schedules of compute_order
                raise PipelineError(f"schedule {schedule!r} deadlocks after {t} slots")
            t += 1
        used = tuple((k.value, cost[k]) for k in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT))
        return cls(schedule, p, m, tuple(tuple(r) for r in rows), used)

    @property
    def num_slots(self) -> int:
        """Time slots of the step, from the first stage's first forward to the last pass."""
        return len(self.slots[0])

    @property
    def idle_slots(self) -> int:
        """Slots, summed over the stages, in which a stage idles."""
        return sum(a is None for row in self.slots for a in row)

    def stage_idle_slots(self, stage: int) -> int:
        """Slots in which ``stage`` idles."""
        return sum(a is None for a in self.slots[stage])

    @property
    def bubble_fraction(self) -> float:
        """Idle slots / all slots (``num_stages * num_slots``): (p - 1) / (m + p - 1) for GPipe
        and 1F1B in unit time."""
        return self.idle_slots / (self.num_stages * self.num_slots)

    def _passes(self) -> str:
        cost = dict(self.durations)
        kinds = ["F", "B", "W"] if self.schedule in SPLIT_BACKWARD else ["F", "B"]
        if all(cost[k] == 1 for k in kinds):
            return f"{', '.join(kinds[:-1])} and {kinds[-1]} one time slot each"
        return ", ".join(f"{k} {cost[k]} slot{'s' * (cost[k] != 1)}" for k in kinds)

    def __str__(self) -> str:
        p, n = self.num_stages, self.num_slots
        cells = [[str(a) if a is not None else "." for a in row] for row in self.slots]
        width = max(len(str(n - 1)), *(len(c) for row in cells for c in row))
        label = len(f"stage {p - 1}")
        m = self.num_micro_batches
        lines = [f"{self.schedule}: {p} stage{'s' * (p != 1)}, {m} micro-batch{'es' * (m != 1)}, "
                 + self._passes(),
                 " ".join(["slot".rjust(label)] + [str(t).rjust(width) for t in range(n)])]
        lines += [" ".join([f"stage {s}".rjust(label)] + [c.rjust(width) for c in row])
                  for s, row in enumerate(cells)]
        lines.append(f"bubble fraction: {self.bubble_fraction:.3f} "
                     f"({self.idle_slots} of {p * n} slots idle)")
        return "\n".join(lines)


def schedule_grid(schedule: str, num_stages: int, num_micro_batches: int, durations: dict | None = None) -> str:
    """``schedule`` (``"gpipe"``, ``"1f1b"`` or ``"zb-h1"``) printed as a stage x time-slot grid.

    One row per stage, one column per time slot of a training step with unit-time passes
    unless ``durations`` says otherwise (see :class:`ScheduleGrid`); a cell is the pass
    that stage runs then (``F3``: forward of micro-batch 3, ``B3`` its backward, ``W3``
    its weight gradients under ZB-H1) or ``.`` where it idles. The last line is the
    bubble: idle slots / all slots. A pure function (no model, no TensorFlow).

        print(tnt.pipelining.schedule_grid("zb-h1", 4, 8))
        print(tnt.pipelining.schedule_grid("1f1b", 4, 8, durations={"B": 2}))  # same work

    Raises PipelineError for an unknown schedule or a count below 1.
    """
    return str(ScheduleGrid.simulate(schedule, num_stages, num_micro_batches, durations))


def activation_bound(schedule: str, num_stages: int, num_micro_batches: int) -> int:
    """The most micro-batches' activations a stage may hold under ``schedule``: all m for
    GPipe, 1F1B's peak (its stage 0's, ``min(p, m)``) for 1F1B and ZB-H1."""
    check_schedule(schedule)
    return num_micro_batches if schedule == "gpipe" else min(num_stages, num_micro_batches)


def verify(plan, schedule: str, num_micro_batches: int, training: bool = True) -> dict[int, list[Action]]:
    """Check every stage's :func:`actions` of ``plan`` against the others before they run.

    Raises a PipelineError when a send has no receive on its peer (or a receive no send),
    when the stages deadlock (sends non-blocking, receives blocking: the run is simulated
    action by action), or when a stage holds more micro-batches' activations than its
    schedule's bound (:func:`activation_bound`: 1F1B's for 1F1B and ZB-H1). Returns the action lists, by stage.
    """
    p, m = plan.num_stages, num_micro_batches
    lists = {s: actions(plan, schedule, m, s, training) for s in range(p)}
    sent: dict[tuple, int] = {}
    wanted: dict[tuple, int] = {}
    for s, todo in lists.items():
        for a in todo:
            if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                key = (a.kind.value[5:], a.micro_batch, a.boundary, s, a.peer)
                sent[key] = sent.get(key, 0) + 1
            elif a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                key = (a.kind.value[5:], a.micro_batch, a.boundary, a.peer, s)
                wanted[key] = wanted.get(key, 0) + 1
    for key in sorted(set(sent) | set(wanted)):
        if sent.get(key, 0) != wanted.get(key, 0):
            what, i, b, src, dst = key
            raise PipelineError(
                f"schedule {schedule!r}: stage {src} sends {sent.get(key, 0)} and stage {dst} receives "
                f"{wanted.get(key, 0)} {what.lower()} message(s) of micro-batch {i}, boundary {b}; "
                "every send needs exactly one receive (a plan or schedule bug: please report it).")
    delivered: set[tuple] = set()
    pos = dict.fromkeys(lists, 0)
    while any(pos[s] < len(lists[s]) for s in lists):
        moved = False
        for s, todo in lists.items():
            while pos[s] < len(todo):
                a = todo[pos[s]]
                if a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                    key = (a.kind.value[5:], a.micro_batch, a.boundary, a.peer, s)
                    if key not in delivered:
                        break
                elif a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                    delivered.add((a.kind.value[5:], a.micro_batch, a.boundary, s, a.peer))
                pos[s] += 1
                moved = True
        if not moved:
            stuck = "; ".join(f"stage {s} at {lists[s][pos[s]]}" for s in lists if pos[s] < len(lists[s]))
            raise PipelineError(f"schedule {schedule!r} with {m} micro-batches deadlocks: {stuck}.")
    if training:
        bound = activation_bound(schedule, p, m)
        for s in range(p):
            peak = peak_in_flight(compute_order(schedule, p, m, s, training))
            if peak > bound:
                raise PipelineError(f"schedule {schedule!r}: stage {s} holds {peak} micro-batches' "
                                    f"activations, above the bound {bound} (activation_bound).")
    return lists
