"""Communication-only job (no TensorFlow: starts in a fraction of a second per rank).

    steps.py --out DIR --scenario {report,train,raise,sleep}

Every rank writes DIR/pid-<rank> ("pid host"). `report`: rank 0 writes DIR/result.json
with every rank's identity and environment (gathered), the bytes each rank's fused
allreduce agrees on, and the fused engine's bus bandwidth. `train`/`raise`: "steps" of
fused allreduces until killed; rank 0 writes DIR/training once steps run; with `raise`
the last rank raises at step 5 after writing the time to DIR/failed_at. `sleep`: no MPI,
just a process to find (a leftover of a crashed job, for --cleanup).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import numpy as np

import tnt_comm

#: A gradient-like set: 24 tensors, 8 MiB of float32 in total, 4 MiB buckets.
SPECS = [tnt_comm.TensorSpec(f"grad{i}", 87381, "float32") for i in range(24)]
THRESHOLD = 4 << 20
ENV_KEYS = ("TNT_MH_EXPORT", "TNT_MH_SPACES", "TNT_COMM_TIMEOUT", "VIRTUAL_ENV", "OMPI_MCA_btl")


def step(engine: tnt_comm.FusedAllreduce, rank: int) -> list[np.ndarray]:
    for i, spec in enumerate(SPECS):
        engine.submit(i, np.full(spec.count, rank + i, dtype=np.float32))
    return engine.wait()


def busbw(engine: tnt_comm.FusedAllreduce, rank: int, size: int, rounds: int = 7) -> dict:
    """Median time of one fused round, as bus bandwidth (2 (N-1)/N bytes / time)."""
    nbytes = sum(s.nbytes for s in SPECS)
    times = []
    for r in range(rounds + 2):
        tnt_comm.barrier()
        start = time.perf_counter()
        step(engine, rank)
        if r >= 2:  # warm-up rounds not counted
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"bytes": nbytes, "seconds": seconds,
            "busbw_gbs": 2 * (size - 1) / size * nbytes / seconds / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", choices=("report", "train", "raise", "sleep"), required=True)
    args = parser.parse_args()
    if args.scenario == "sleep":
        time.sleep(300)
        return
    rank, size = tnt_comm.rank(), tnt_comm.size()
    (args.out / f"pid-{rank}").write_text(f"{os.getpid()} {socket.gethostname()}")
    engine = tnt_comm.FusedAllreduce(SPECS, THRESHOLD)
    if args.scenario == "report":
        reduced = step(engine, rank)
        me = {"rank": rank, "size": size, "local_rank": tnt_comm.local_rank(),
              "local_size": tnt_comm.local_size(), "host": socket.gethostname(),
              "env": {k: os.environ.get(k) for k in ENV_KEYS},
              "reduced_ok": all(np.all(r == sum(range(size)) + size * i)
                                for i, r in enumerate(reduced))}
        print(f"stdout of rank {rank} on {me['host']}", flush=True)
        everyone = tnt_comm.allgather_object(me)
        bw = busbw(engine, rank, size)
        if rank == 0:
            (args.out / "result.json").write_text(json.dumps({"ranks": everyone, "busbw": bw}))
        return
    for n in range(10**9):
        if n == 3 and rank == 0:
            (args.out / "training").write_text(repr(time.time()))
        if n == 5 and args.scenario == "raise" and rank == size - 1:
            (args.out / "failed_at").write_text(repr(time.time()))
            raise RuntimeError(f"deliberate failure on rank {rank} ({socket.gethostname()})")
        step(engine, rank)


if __name__ == "__main__":
    main()
