"""Pipeline stages balanced by measured time: contiguous cuts of the profile's layer order
minimising the slowest stage's time in a step (dynamic programming over cut points, as Alpa does for its
stages). The pipeline's own plan balances parameter bytes; the planner predicts both and
keeps the faster within the budget.
"""

from __future__ import annotations

from ._profile import Profile


def time_split_after(prof: Profile, p: int, rows: int, micro_batches: int | None = None) -> list[str] | None:
    """Names of the layers ending stages 0..p-2 (None: fewer than p layers).

    ``micro_batches``: a stage's time in a step is then its layers' ``micro_batches`` forward
    + backward passes plus what its variables cost once per step (their update, the executor's
    per-variable work: ``Profile.pipeline_update_s``); without it, one micro-batch's layers.
    A layer holding most of the weights updates most of the bytes: a CNN's stage with its
    large Dense layers was 1.5x busier than the convolutions' stage when only the passes counted."""
    if micro_batches is None:
        times = [c.time_s(rows) for c in prof.layers]
    else:
        times = [micro_batches * c.time_s(rows) + prof.pipeline_update_s([c.name]) for c in prof.layers]
    n = len(times)
    if n < p:
        return None
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    # best[k][i]: the slowest stage of the best cut of layers [0, i) into k stages
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    ends, i = [], n
    for k in range(p, 1, -1):
        i = cut[k][i]
        ends.append(i)
    return [prof.layers[i - 1].name for i in reversed(ends)]
