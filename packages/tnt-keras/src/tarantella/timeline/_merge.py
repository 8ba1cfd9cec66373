"""Gather every rank's events on the master, put them on the master's clock, write JSON.

Clock offsets: ranks on different hosts have clocks that differ by up to milliseconds,
more than a micro-batch's pass. The master exchanges a few pings with each rank and keeps
the exchange with the shortest round trip: offset = rank's time - the midpoint of the
master's send and receive (error at most half that round trip, recorded in the file).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

import tnt_comm

from .._core.trace import LANES, Recorder

_PINGS = 8


def _clock_offsets(comm) -> tuple[list[float], list[float]]:
    """Per rank: its clock minus the master's, and the round trip it was measured with."""
    rank, size = comm.rank, comm.size
    offsets, rtts = [0.0] * size, [0.0] * size
    for r in range(1, size):
        if rank == 0:
            best = (float("inf"), 0.0)
            for k in range(_PINGS):
                t0 = time.time()
                comm.send(np.array([t0]), r, (k,))
                tr = float(comm.recv(r, (k,), np.float64, (1,))[0])
                t2 = time.time()
                best = min(best, (t2 - t0, tr - (t0 + t2) / 2))
            rtts[r], offsets[r] = best
        elif rank == r:
            for k in range(_PINGS):
                comm.recv(0, (k,), np.float64, (1,))
                comm.send(np.array([time.time()]), 0, (k,))
    return offsets, rtts


def _rank_events(rec: Recorder) -> dict:
    return {"wall_minus_perf": rec.wall_minus_perf, "meta": rec.meta,
            "events": [(n, c, lane, s, e, a) for n, c, lane, s, e, a in rec.events]}


def chrome_trace(parts: list[dict], offsets: list[float], rtts: list[float]) -> dict:
    """The Chrome-trace dict of every rank's events on the master's clock (µs from the
    first event); ``pid`` is the rank, ``tid`` the lane (step, compute, comm, sync, data)."""
    starts = [p["wall_minus_perf"] - off + e[3] for p, off in zip(parts, offsets) for e in p["events"]]
    origin = min(starts) if starts else 0.0
    out: list[dict] = []
    for r, (part, off) in enumerate(zip(parts, offsets)):
        stages = sorted({e[5]["stage"] for e in part["events"] if "stage" in e[5]})
        label = f"rank {r}" + (f" (stage {', '.join(map(str, stages))})" if stages else "")
        out.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": label}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for k, lane in enumerate(LANES):
            out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": k, "args": {"name": lane}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": r, "tid": k, "args": {"sort_index": k}})
        base = part["wall_minus_perf"] - off - origin
        for name, cat, lane, start, end, args in part["events"]:
            out.append({"name": name, "cat": cat, "ph": "X", "pid": r, "tid": LANES.index(lane),
                        "ts": round((base + start) * 1e6, 3), "dur": round((end - start) * 1e6, 3),
                        "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"tarantella": {"ranks": len(parts), "clock_offsets_s": offsets,
                                         "clock_offset_error_s": [x / 2 for x in rtts],
                                         "origin_unix_s": origin}}}


def merge_and_write(rec: Recorder, path: str) -> dict | None:
    """Collective: the master writes the merged trace of all ranks to ``path`` (atomically)
    and returns it; the other ranks return None."""
    comm = tnt_comm.world().dup()
    offsets, rtts = _clock_offsets(comm)
    parts = comm.allgather_object(_rank_events(rec)) if comm.size > 1 else [_rank_events(rec)]
    trace = None
    if comm.rank == 0:
        trace = chrome_trace(parts, offsets, rtts)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(trace, f)
        os.replace(tmp, path)
    comm.barrier()
    return trace


def load(path: str) -> dict:
    """A timeline file as written (a ValueError naming the file if it is not one)."""
    with open(path) as f:
        try:
            trace = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a timeline: not JSON ({e})") from None
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ValueError(f"{path} is not a timeline: no 'traceEvents' (write one with tnt.timeline or TNT_TIMELINE)")
    return trace
