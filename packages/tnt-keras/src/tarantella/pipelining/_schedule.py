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

- ``interleaved`` (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC 2021): the model is cut into p * v chunks and stage
  (rank) r holds the v non-adjacent chunks r, r + p, r + 2p, ... (``virtual_stages=v``).
  Micro-batches go in groups of p: each stage runs a group's forwards on its first chunk,
  then on its second ..., and the backwards in the reverse chunk order; 1F1B's warm-up
  becomes ``2 (p - r - 1) + (v - 1) p`` chunk forwards. Every action names its chunk
  (``F3c2``: forward of micro-batch 3 on chunk 2). Bubble (p - 1) / (v m) of the compute
  when m is a multiple of p; a stage holds at most ``(v + 1) p - 1`` chunk activation
  sets (each about 1 / v of a 1F1B stage's).

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

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved")
#: The schedules whose stages hold several chunks (``virtual_stages``).
INTERLEAVED = ("interleaved",)
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
    sends boundary 0 of micro-batch 3 to stage 1. Under the interleaved schedule ``chunk``
    is the model chunk (plan stage) the action belongs to and ``peer`` a chunk too (held by
    stage ``peer % p``): ``F3c2``, ``SEND_ACT(mb=3, b=1, chunk=1, peer=2)``; -1 elsewhere.
    """

    kind: ActionKind
    micro_batch: int
    boundary: int = -1
    peer: int = -1
    chunk: int = -1

    def __post_init__(self) -> None:
        try:
            kind = ActionKind(self.kind)
        except ValueError:
            raise PipelineError(f"action kind {self.kind!r} is unknown; use one of "
                                f"{', '.join(k.value for k in ActionKind)}.") from None
        object.__setattr__(self, "kind", kind)

    def __str__(self) -> str:
        if self.kind in _COMPUTE:
            return f"{self.kind}{self.micro_batch}" + (f"c{self.chunk}" if self.chunk >= 0 else "")
        if self.chunk >= 0:
            return f"{self.kind}(mb={self.micro_batch}, b={self.boundary}, chunk={self.chunk}, peer={self.peer})"
        return f"{self.kind}(mb={self.micro_batch}, b={self.boundary}, stage={self.peer})"

    __repr__ = __str__


def check_schedule(name: str) -> str:
    """``name`` if it is a known schedule, else a PipelineError listing them."""
    if name not in SCHEDULES:
        raise PipelineError(f"pipeline_schedule={name!r} is unknown; use one of {', '.join(SCHEDULES)}.")
    return name


def check_virtual_stages(schedule: str, virtual_stages) -> int:
    """``virtual_stages`` (chunks per stage) if it fits ``schedule``, else a PipelineError
    naming the fix: the interleaved schedule needs v >= 2, every other schedule v = 1."""
    v = virtual_stages
    if v is None:
        v = 2 if schedule in INTERLEAVED else 1
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PipelineError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}.")
    if schedule in INTERLEAVED and v < 2:
        raise PipelineError(f"pipeline_schedule={schedule!r} needs virtual_stages >= 2 (the model chunks "
                            f"each stage holds), got {v}; pass virtual_stages=2 or more, or use "
                            "pipeline_schedule='1f1b'.")
    if schedule not in INTERLEAVED and v != 1:
        raise PipelineError(f"virtual_stages={v} needs pipeline_schedule='interleaved' (pipeline_schedule="
                            f"{schedule!r} runs one chunk per stage); pass pipeline_schedule='interleaved' "
                            "or leave virtual_stages out.")
    return v


def check_interleaved_micro_batches(num_stages: int, num_micro_batches: int) -> None:
    """The interleaved schedule's rule: micro-batches in whole groups of p (Megatron-LM's)."""
    if num_micro_batches % num_stages:
        lower = num_micro_batches - num_micro_batches % num_stages
        raise PipelineError(
            f"pipeline_schedule='interleaved' needs num_micro_batches to be a multiple of "
            f"num_pipeline_stages={num_stages} (micro-batches go through the chunks in groups of "
            f"{num_stages}), got {num_micro_batches}; pass num_micro_batches="
            f"{lower or num_stages} or {lower + num_stages}.")


def _interleaved_order(p: int, v: int, m: int, r: int, training: bool) -> list[Action]:
    """Megatron's interleaved 1F1B order of stage ``r`` (see the module docstring).

    Micro-batches go in groups of p; within a group, chunk by chunk. Each chunk sees its
    micro-batches in increasing order, forwards and backwards alike. A count that is no
    multiple of p (a batch smaller than ``num_micro_batches``: an epoch's last) leaves a
    short group, after which the warm-up formula can deadlock: such a step runs all its
    forwards first (GPipe in the interleaved order, deadlock-free: every stage follows one
    global order of (group, chunk, micro-batch)).
    """
    groups = [range(g, min(g + p, m)) for g in range(0, m, p)]
    chunks = [j * p + r for j in range(v)]
    fwd = [Action(ActionKind.FORWARD, i, chunk=c) for grp in groups for c in chunks for i in grp]
    if not training:
        return fwd
    bwd = [Action(ActionKind.BACKWARD, i, chunk=c) for grp in groups for c in reversed(chunks) for i in grp]
    total = len(fwd)
    warmup = min(2 * (p - r - 1) + (v - 1) * p, total) if m % p == 0 else total
    order = fwd[:warmup]
    for k in range(total - warmup):
        order += [fwd[warmup + k], bwd[k]]
    order += bwd[total - warmup:]
    return order


def compute_order(schedule: str, num_stages: int, num_micro_batches: int, stage: int,
                  training: bool = True, virtual_stages: int | None = None) -> list[Action]:
    """The F/B(/W) order of ``stage``; forward-only (evaluate, predict) when not ``training``.

    ``virtual_stages`` (v, interleaved only) is the number of chunks each of the
    ``num_stages`` stages holds; the actions then carry their chunk.
    """
    check_schedule(schedule)
    v = check_virtual_stages(schedule, virtual_stages)
    p, m, s = num_stages, num_micro_batches, stage
    if not 0 <= s < p:
        raise PipelineError(f"stage {s} is not in 0..{p - 1}")
    if m < 0:
        raise PipelineError(f"number of micro-batches must be >= 0, got {m}")
    if schedule in INTERLEAVED:
        return _interleaved_order(p, v, m, s, training)
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


def _order(schedule: str, p: int, m: int, s: int, training: bool, v: int) -> list[Action]:
    if v == 1:
        return compute_order(schedule, p, m, s, training)
    return compute_order(schedule, p, m, s, training, virtual_stages=v)


def num_chunks_per_stage(plan, schedule: str, virtual_stages: int | None = None) -> tuple[int, int]:
    """(p, v): the stages (ranks) of ``plan`` under ``schedule`` and the chunks each holds;
    an interleaved plan's p * v stages are its chunks."""
    v = check_virtual_stages(schedule, virtual_stages)
    if plan.num_stages % v:
        raise PipelineError(f"the plan has {plan.num_stages} chunks, not a multiple of virtual_stages={v}; "
                            "plan the model into num_pipeline_stages * virtual_stages chunks.")
    return plan.num_stages // v, v


def actions(plan, schedule: str, num_micro_batches: int, stage: int, training: bool = True,
            virtual_stages: int | None = None) -> list[Action]:
    """``compute_order`` with the receives and sends of ``plan``'s boundaries around it.

    Receives and sends of one micro-batch run in boundary order, per peer, so messages
    between two stages arrive in the order they were sent. Under the interleaved schedule
    ``plan``'s stages are the p * v chunks and ``stage`` is a rank's pipeline position.
    """
    p, v = num_chunks_per_stage(plan, schedule, virtual_stages)
    out: list[Action] = []
    for a in _order(schedule, p, num_micro_batches, stage, training, v):
        i, c = a.micro_batch, a.chunk
        st = plan.stages[c if c >= 0 else stage]
        if a.kind is ActionKind.WEIGHT:
            out.append(a)
        elif a.kind is ActionKind.FORWARD:
            for b in st.inputs:
                out.append(Action(ActionKind.RECV_ACT, i, b, plan.boundaries[b].producer, c))
            out.append(a)
            for b in st.outputs:
                for d in plan.boundaries[b].consumers:
                    out.append(Action(ActionKind.SEND_ACT, i, b, d, c))
        else:
            for b in st.outputs:
                if plan.boundaries[b].differentiable:
                    for d in plan.boundaries[b].consumers:
                        out.append(Action(ActionKind.RECV_GRAD, i, b, d, c))
            out.append(a)
            for b in st.inputs:
                if plan.boundaries[b].differentiable:
                    out.append(Action(ActionKind.SEND_GRAD, i, b, plan.boundaries[b].producer, c))
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


def _depends_on(a: Action, stage: int, num_chunks: int) -> tuple[ActionKind, int, int] | None:
    """The (kind, micro-batch, chunk) pass that must end before ``a`` on ``stage`` starts
    (a chunk is a stage where the schedule has one chunk per stage)."""
    c = a.chunk if a.chunk >= 0 else stage
    if a.kind is ActionKind.FORWARD:
        return (ActionKind.FORWARD, a.micro_batch, c - 1) if c > 0 else None
    if a.kind is ActionKind.WEIGHT:
        return (ActionKind.BACKWARD, a.micro_batch, c)
    if c < num_chunks - 1:
        return (ActionKind.BACKWARD, a.micro_batch, c + 1)
    return (ActionKind.FORWARD, a.micro_batch, c)


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
    after its forward ``i``), W ``i`` after B ``i`` on the same stage; under the interleaved
    schedule the same holds between chunks (a pass on one chunk, ``1 / v`` of a stage,
    takes the slots). Communication takes no time. ``str()`` prints the grid, one row per stage, and the bubble as its last
    line. Build one with :meth:`simulate`.
    """

    schedule: str
    num_stages: int
    num_micro_batches: int
    slots: tuple[tuple[Action | None, ...], ...]
    durations: tuple[tuple[str, int], ...] = (("F", 1), ("B", 1), ("W", 1))
    virtual_stages: int = 1

    @classmethod
    def simulate(cls, schedule: str, num_stages: int, num_micro_batches: int,
                 durations: dict | None = None, virtual_stages: int | None = None) -> ScheduleGrid:
        """The grid of a training step of ``schedule`` with ``num_stages`` stages and
        ``num_micro_batches`` micro-batches; ``durations`` maps ``"F"``, ``"B"``, ``"W"`` to
        slots (``{"B": 2}`` gives 1F1B's joint backward the time of ZB-H1's B + W). A
        PipelineError for an unknown schedule, a count below 1 or a deadlock."""
        check_schedule(schedule)
        p = _check_count("num_stages", num_stages, "the number of pipeline stages (num_pipeline_stages)")
        m = _check_count("num_micro_batches", num_micro_batches,
                         "the number of micro-batches a step is cut into")
        cost = _durations(schedule, durations)
        v = check_virtual_stages(schedule, virtual_stages)
        orders = [_order(schedule, p, m, s, True, v) for s in range(p)]
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
                    needs = _depends_on(a, s, p * v)
                    if needs is not None and ends.get(needs, t + 1) > t:
                        a = None
                rows[s].append(a)
                if a is not None:
                    ran = True
                    nxt[s] += 1
                    busy_until[s] = t + cost[a.kind]
                    ends[(a.kind, a.micro_batch, a.chunk if a.chunk >= 0 else s)] = busy_until[s]
            if not ran:  # cannot happen for the schedules of compute_order
                raise PipelineError(f"schedule {schedule!r} deadlocks after {t} slots")
            t += 1
        used = tuple((k.value, cost[k]) for k in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT))
        return cls(schedule, p, m, tuple(tuple(r) for r in rows), used, v)

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
        and 1F1B in unit time, (p - 1) / (v m + p - 1) interleaved."""
        return self.idle_slots / (self.num_stages * self.num_slots)

    @property
    def bubble_over_compute(self) -> float:
        """Idle slots / busy slots: (p - 1) / m for 1F1B, (p - 1) / (v m) interleaved (with
        m a multiple of p), the ratio Megatron-LM quotes."""
        busy = self.num_stages * self.num_slots - self.idle_slots
        return self.idle_slots / busy if busy else 0.0

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
        m, v = self.num_micro_batches, self.virtual_stages
        chunks = (f" x {v} virtual stages (chunk c on stage c mod {p})" if v > 1 else "")
        lines = [f"{self.schedule}: {p} stage{'s' * (p != 1)}{chunks}, {m} micro-batch{'es' * (m != 1)}, "
                 + self._passes() + (" (per chunk)" if v > 1 else ""),
                 " ".join(["slot".rjust(label)] + [str(t).rjust(width) for t in range(n)])]
        lines += [" ".join([f"stage {s}".rjust(label)] + [c.rjust(width) for c in row])
                  for s, row in enumerate(cells)]
        lines.append(f"bubble fraction: {self.bubble_fraction:.3f} "
                     f"({self.idle_slots} of {p * n} slots idle)")
        return "\n".join(lines)


def schedule_grid(schedule: str, num_stages: int, num_micro_batches: int, durations: dict | None = None,
                  virtual_stages: int | None = None) -> str:
    """``schedule`` (``"gpipe"``, ``"1f1b"``, ``"zb-h1"`` or ``"interleaved"`` with
    ``virtual_stages`` chunks per stage) printed as a stage x time-slot grid.

    One row per stage, one column per time slot of a training step with unit-time passes
    unless ``durations`` says otherwise (see :class:`ScheduleGrid`); a cell is the pass
    that stage runs then (``F3``: forward of micro-batch 3, ``B3`` its backward, ``W3``
    its weight gradients under ZB-H1, ``F3c2`` the forward on chunk 2 when interleaved)
    or ``.`` where it idles. The last line is the bubble: idle slots / all slots. A pure
    function (no model, no TensorFlow).

        print(tnt.pipelining.schedule_grid("zb-h1", 4, 8))
        print(tnt.pipelining.schedule_grid("interleaved", 2, 4, virtual_stages=2))
        print(tnt.pipelining.schedule_grid("1f1b", 4, 8, durations={"B": 2}))  # same work

    Raises PipelineError for an unknown schedule or a count below 1.
    """
    return str(ScheduleGrid.simulate(schedule, num_stages, num_micro_batches, durations, virtual_stages))


def activation_bound(schedule: str, num_stages: int, num_micro_batches: int,
                     virtual_stages: int | None = None) -> int:
    """The most micro-batches' activations a stage may hold under ``schedule``: all m for
    GPipe, 1F1B's peak (its stage 0's, ``min(p, m)``) for 1F1B and ZB-H1; interleaved,
    in chunk activation sets, stage 0's warm-up plus one: ``min(v m, (v + 1) p - 1)`` (all
    ``v m`` for a count of micro-batches that is no multiple of p)."""
    check_schedule(schedule)
    v = check_virtual_stages(schedule, virtual_stages)
    p, m = num_stages, num_micro_batches
    if schedule in INTERLEAVED:
        return min(v * m, (v + 1) * p - 1) if m % p == 0 else v * m
    return m if schedule == "gpipe" else min(p, m)


def verify(plan, schedule: str, num_micro_batches: int, training: bool = True,
           virtual_stages: int | None = None) -> dict[int, list[Action]]:
    """Check every stage's :func:`actions` of ``plan`` against the others before they run.

    Raises a PipelineError when a send has no receive on its peer (or a receive no send),
    when the stages deadlock (sends non-blocking, receives blocking: the run is simulated
    action by action), or when a stage holds more micro-batches' activations than its
    schedule's bound (:func:`activation_bound`: 1F1B's for 1F1B and ZB-H1). Interleaved,
    ``plan``'s stages are the p * v chunks; messages are matched chunk to chunk (two chunks
    of one stage exchange theirs in the stage itself, in its action order). Returns the
    action lists, by stage.
    """
    p, v = num_chunks_per_stage(plan, schedule, virtual_stages)
    m = num_micro_batches
    lists = {s: actions(plan, schedule, m, s, training, v) for s in range(p)}

    def key_of(a: Action, s: int) -> tuple:
        me = a.chunk if a.chunk >= 0 else s
        if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
            return (a.kind.value[5:], a.micro_batch, a.boundary, me, a.peer)
        return (a.kind.value[5:], a.micro_batch, a.boundary, a.peer, me)

    who = "chunk" if v > 1 else "stage"
    sent: dict[tuple, int] = {}
    wanted: dict[tuple, int] = {}
    for s, todo in lists.items():
        for a in todo:
            if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                key = key_of(a, s)
                sent[key] = sent.get(key, 0) + 1
            elif a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                key = key_of(a, s)
                wanted[key] = wanted.get(key, 0) + 1
    for key in sorted(set(sent) | set(wanted)):
        if sent.get(key, 0) != wanted.get(key, 0):
            what, i, b, src, dst = key
            raise PipelineError(
                f"schedule {schedule!r}: {who} {src} sends {sent.get(key, 0)} and {who} {dst} receives "
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
                    if key_of(a, s) not in delivered:
                        break
                elif a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                    delivered.add(key_of(a, s))
                pos[s] += 1
                moved = True
        if not moved:
            stuck = "; ".join(f"stage {s} at {lists[s][pos[s]]}" for s in lists if pos[s] < len(lists[s]))
            raise PipelineError(f"schedule {schedule!r} with {m} micro-batches deadlocks: {stuck}.")
    if training:
        bound = activation_bound(schedule, p, m, v)
        for s in range(p):
            peak = peak_in_flight(_order(schedule, p, m, s, training, v))
            if peak > bound:
                raise PipelineError(f"schedule {schedule!r}: stage {s} holds {peak} micro-batches' "
                                    f"activations, above the bound {bound} (activation_bound).")
    return lists
