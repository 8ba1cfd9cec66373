"""tnt_comm.reduce_scatter and allgather against allreduce of the same bytes (under mpirun).

    mpirun -n 2 python benchmarks/scatter_gather.py [--quick] [--mb 50.4,8.4]

Level 2 of sharded data parallelism (docs/sharding.md) replaces each gradient allreduce by a
reduce_scatter and an allgather of the updated values; a ring allreduce is exactly those two,
so each should cost about half an allreduce. Per size (float32, MB of the whole array):

- ``allreduce``: tnt_comm.allreduce of the whole array;
- ``reduce_scatter``: of the whole array, even split (np.array_split's);
- ``reduce_scatter_owner``: all of it to rank 0 (counts [n, 0, ...]: level 2's bucket that
  one replica owns whole, e.g. a large kernel);
- ``allgather``: of this rank's even block (the whole array comes back);
- ``reduce_scatter_allgather``: the two in sequence (what level 2 moves per bucket).

Every time is the median over repetitions of the slowest rank's time, a barrier before each
call; the kinds alternate within each repetition, so a neighbour's load hits them alike.
Prints one BENCH_RESULT line per size (benchlib.parse_results reads them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import tnt_comm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mb", default="50.4,8.4", help="comma-separated sizes in MB (float32)")
    parser.add_argument("--reps", type=int, default=0)
    args = parser.parse_args()
    reps = args.reps or (7 if args.quick else 21)
    for mb in (float(s) for s in args.mb.split(",")):
        record = measure(int(mb * 1e6) // 4, reps)
        if record is not None:
            print("BENCH_RESULT " + json.dumps(record), flush=True)


def measure(n: int, reps: int) -> dict | None:
    """One size: every kind's median of the slowest rank (a record on rank 0, else None)."""
    rank, size = tnt_comm.rank(), tnt_comm.size()
    buf = np.random.default_rng(rank).normal(size=n).astype(np.float32)
    block = np.array_split(buf, size)[rank].copy()
    owner = [n] + [0] * (size - 1)
    kinds = {
        "allreduce": lambda: tnt_comm.allreduce(buf),
        "reduce_scatter": lambda: tnt_comm.reduce_scatter(buf),
        "reduce_scatter_owner": lambda: tnt_comm.reduce_scatter(buf, owner),
        "allgather": lambda: tnt_comm.allgather(block),
        "reduce_scatter_allgather": lambda: tnt_comm.allgather(tnt_comm.reduce_scatter(buf)),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(reps + 1):  # the first round is a warm-up
        for kind, fn in kinds.items():
            tnt_comm.barrier()
            t0 = time.perf_counter()
            fn()
            if rep:
                times[kind].append(time.perf_counter() - t0)
    slowest = {k: [max(ts) for ts in zip(*tnt_comm.allgather_object(v))] for k, v in times.items()}
    if rank != 0:
        return None
    record = {"ranks": size, "bytes": buf.nbytes, "reps": reps}
    for k, v in slowest.items():
        record[k + "_ms"] = round(statistics.median(v) * 1e3, 2)
        record[k + "_range_ms"] = [round(min(v) * 1e3, 2), round(max(v) * 1e3, 2)]
    record["reduce_scatter_allgather_vs_allreduce"] = round(
        record["reduce_scatter_allgather_ms"] / record["allreduce_ms"], 2)
    return record

if __name__ == "__main__":
    main()
