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
"""

from __future__ import annotations

from dataclasses import dataclass

from .._core.errors import PipelineError

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    """One step of a stage: ``kind`` in F, B (compute), RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD.

    ``boundary`` and ``peer`` (a stage index) are set for communication actions.
    """

    kind: str
    micro_batch: int
    boundary: int = -1
    peer: int = -1

    def __str__(self) -> str:
        if self.kind in ("F", "B"):
            return f"{self.kind}{self.micro_batch}"
        return f"{self.kind}(mb={self.micro_batch}, b={self.boundary}, stage={self.peer})"


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
    forwards = [Action("F", i) for i in range(m)]
    backwards = [Action("B", i) for i in range(m)]
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
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind == "B":
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
        if a.kind == "F":
            for b in st.inputs:
                out.append(Action("RECV_ACT", i, b, plan.boundaries[b].producer))
            out.append(a)
            for b in st.outputs:
                for c in plan.boundaries[b].consumers:
                    out.append(Action("SEND_ACT", i, b, c))
        else:
            for b in st.outputs:
                if plan.boundaries[b].differentiable:
                    for c in plan.boundaries[b].consumers:
                        out.append(Action("RECV_GRAD", i, b, c))
            out.append(a)
            for b in st.inputs:
                if plan.boundaries[b].differentiable:
                    out.append(Action("SEND_GRAD", i, b, plan.boundaries[b].producer))
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
