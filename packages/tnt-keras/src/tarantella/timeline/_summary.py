"""Per-rank figures from a timeline: compute, exposed communication, overlap, idle.

- *window*: the rank's steps (the union of its ``step`` events), else first to last event;
- *compute*: the union of its forward / backward / weight passes (``F``, ``B``, ``W``);
- *communication*: sends, gradient-sync calls, fusion buckets (submit -> done) and waits
  for buckets; *exposed* is the time the rank's thread sits in a send, a gradient sync or
  a wait, outside compute (a data-parallel bucket's time before the step's wait runs
  behind backprop, so it is hidden); *overlap* is 1 - exposed / communication;
- *idle* (the bubble): window - compute - exposed communication. Receive waits count
  here: a stage waiting for its neighbour's activation or gradient idles for the schedule.
  None where no pass was recorded (a traced data-parallel step: its compute is unknown).
"""

from __future__ import annotations

COMPUTE = ("forward", "backward", "weight", "compute")
COMMUNICATION = ("send", "sync", "bucket", "wait")
#: Communication the rank's thread sits in (a bucket's time outside its wait is not).
BLOCKING = ("send", "sync", "wait")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union ``a`` without union ``b`` (both sorted, disjoint)."""
    out = []
    for s, e in a:
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= e:
                break
        if cur < e:
            out.append((cur, e))
    return out


def _clip(intervals, window):
    return [(max(s, ws), min(e, we)) for s, e in intervals for ws, we in window if min(e, we) > max(s, ws)]


def summarize(trace: dict) -> dict:
    """``{"ranks": [per-rank dict], "slowest_stage": ...}`` of a timeline (times in seconds)."""
    by_rank: dict[int, list[dict]] = {}
    for ev in trace["traceEvents"]:
        if ev.get("ph") == "X":
            by_rank.setdefault(int(ev["pid"]), []).append(ev)
    ranks = []
    for r in sorted(by_rank):
        evs = by_rank[r]

        def spans(cats, evs=evs):
            return _union([(e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6) for e in evs if e.get("cat") in cats])

        steps = spans(("step",))
        window = steps or _union([(min(e["ts"] for e in evs) * 1e-6, max(e["ts"] + e["dur"] for e in evs) * 1e-6)])
        compute = _clip(spans(COMPUTE), window)
        comm = _clip(spans(COMMUNICATION), window)
        exposed = _minus(_clip(spans(BLOCKING), window), compute)
        total, busy = _length(window), _length(compute)
        comm_s, exposed_s = _length(comm), _length(exposed)
        stage_set = sorted({e["args"]["stage"] for e in evs if "stage" in e.get("args", {})})
        passes = {k: sum(e["dur"] for e in evs if e.get("cat") == k) * 1e-6 for k in ("forward", "backward", "weight")}
        ranks.append({
            "rank": r, "stages": stage_set, "steps": len(steps), "window_s": total, "compute_s": busy,
            **{f"{k}_s": v for k, v in passes.items()},
            "communication_s": comm_s, "exposed_communication_s": exposed_s,
            "overlap_fraction": (1.0 - exposed_s / comm_s) if comm_s > 0 else None,
            # no passes recorded (a traced data-parallel step): its compute is unknown, so its idle too
            "idle_s": max(0.0, total - busy - exposed_s) if compute else None,
            "idle_fraction": max(0.0, total - busy - exposed_s) / total if compute and total > 0 else None,
            "bytes_sent": sum(e["args"].get("bytes", 0) for e in evs if e.get("cat") == "send"),
            # Keras' loop between steps (the next batch, callbacks): outside the window
            "between_steps_s": sum(e["dur"] for e in evs if e.get("cat") == "host") * 1e-6,
        })
    slowest = None
    staged = [x for x in ranks if x["stages"]]
    if staged:
        top = max(staged, key=lambda x: x["compute_s"])
        slowest = {"stage": top["stages"][0], "rank": top["rank"], "compute_s": top["compute_s"]}
    return {"ranks": ranks, "slowest_stage": slowest}


def format_summary(summary: dict) -> str:
    """The summary as a table, one row per rank, and the slowest stage."""
    head = f"{'rank':>4} {'stage':>5} {'steps':>5} {'window s':>9} {'compute s':>9} {'F/B/W s':>17} " \
           f"{'comm s':>8} {'exposed s':>9} {'overlap':>7} {'idle s':>8} {'idle':>6}"
    lines = [head]
    for x in summary["ranks"]:
        fbw = f"{x['forward_s']:.3f}/{x['backward_s']:.3f}/{x['weight_s']:.3f}"
        overlap = "-" if x["overlap_fraction"] is None else f"{x['overlap_fraction']:.2f}"
        idle = "-" if x["idle_fraction"] is None else f"{x['idle_fraction']:.3f}"
        idle_s = "-" if x["idle_s"] is None else f"{x['idle_s']:.3f}"
        stage = ",".join(map(str, x["stages"])) or "-"
        lines.append(f"{x['rank']:>4} {stage:>5} {x['steps']:>5} {x['window_s']:9.3f} {x['compute_s']:9.3f} "
                     f"{fbw:>17} {x['communication_s']:8.3f} {x['exposed_communication_s']:9.3f} "
                     f"{overlap:>7} {idle_s:>8} {idle:>6}")
    s = summary["slowest_stage"]
    if s is not None:
        lines.append(f"slowest stage: {s['stage']} (rank {s['rank']}, compute {s['compute_s']:.3f} s)")
    return "\n".join(lines)
