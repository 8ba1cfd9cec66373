"""The bubble as the theory counts it: idle time of each stage over the pipeline's span.

A stage's own schedule clock starts when it enters the step and stops when its last
action is done; the last stage finishes a backward pass before stage 0 does and leaves,
so its drain is never on its own clock, and a stage that enters late hides its wait in
the previous step. The theory's (p - 1) / (m + p - 1) is of the whole pipelined step:
from the first stage starting it to the last one finishing it. So each step's span is
[earliest start, latest end] over the stages' schedule windows (wall clock), and a
stage's idle fraction is 1 - (its compute seconds) / (sum of the spans).
"""

from __future__ import annotations

from collections.abc import Sequence


def pipeline_idle_fractions(stage_stats: Sequence[dict]) -> list[float]:
    """Idle fraction of each stage over the steps' spans, from every stage's ``pipeline_stats()``.

    ``stage_stats`` are the stats of the stages of one pipeline (any order); the steps are
    matched by position, so all must cover the same train steps (take them after the same
    ``reset``). The windows' clocks must agree (ranks of one host).
    """
    windows = [s["windows"] for s in stage_stats]
    steps = {len(w) for w in windows}
    if len(steps) != 1:
        raise ValueError(f"the stages recorded different numbers of steps ({sorted(steps)}): "
                         "take every stage's pipeline_stats after the same steps")
    span = sum(max(w[k][1] for w in windows) - min(w[k][0] for w in windows) for k in range(steps.pop()))
    if span <= 0:
        raise ValueError("no train step recorded: call fit before pipeline_stats")
    return [1.0 - sum(busy for _, _, busy in w) / span for w in windows]
