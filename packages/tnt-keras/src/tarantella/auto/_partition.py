"""Pipeline stages balanced by measured time: contiguous cuts of the profile's layer order
minimising the slowest stage (dynamic programming over cut points, as Alpa does for its
stages). The pipeline's own plan balances parameter bytes; the planner predicts both and
keeps the faster within the budget.
"""

from __future__ import annotations

from ._profile import Profile


def time_split_after(prof: Profile, p: int, rows: int) -> list[str] | None:
    """Names of the layers ending stages 0..p-2 (None: fewer than p layers)."""
    times = [c.time_s(rows) for c in prof.layers]
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
