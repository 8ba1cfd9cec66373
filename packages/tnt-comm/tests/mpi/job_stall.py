"""Rank N-1 skips a collective: every other rank's collective must end with StallError
after TNT_COMM_TIMEOUT, naming the collective, the missing rank and the variable.

MODE=plain: an allreduce is skipped. MODE=fused: rank N-1 never submits tensor 'late',
so the other ranks' bucket stalls and rank N-1's own wait() reports the unsubmitted tensor.
MODE=recv: rank 0 waits for a message rank N-1 never sends.
MODE=busy: rank 0 works alone inside long_local_work() for longer than the timeout while
the others wait in a barrier: no StallError.
MODE=init: rank N-1 starts tnt_comm only after the timeout: start-up fails with StallError.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import tnt_comm as t

sys.path.insert(0, os.path.dirname(__file__))
from _harness import watchdog

watchdog(60)
mode = os.environ["MODE"]
limit = float(os.environ["TNT_COMM_TIMEOUT"])
if mode == "init":
    if os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
        time.sleep(limit + 6)  # the scenario: rank 1 starts after the others' start-up limit
    try:
        t.init()
        print(f"rank {t.rank()}: NO ERROR", flush=True)
    except t.StallError as e:
        print(f"rank ?: INIT STALL: {e}", flush=True)
    t.abort(3)
R, N = t.rank(), t.size()
if mode == "busy":
    t.barrier()
    if R == 0:
        with t.long_local_work():
            time.sleep(limit * 3)  # e.g. writing a large checkpoint
    t.barrier()  # the others wait here for 3x the timeout, and must not give up
    print(f"rank {R}: BUSY OK", flush=True)
    sys.exit(0)
t.barrier()
start = time.perf_counter()
try:
    if mode == "recv":
        if R == 0:
            t.world().recv(N - 1, (3, 0, 0), np.float32, (4,))
        else:
            time.sleep(limit + 4)  # idle, still answering
    elif mode == "plain":
        if R != N - 1:
            t.allreduce(np.ones(10, np.float32))
        else:
            time.sleep(limit + 4)  # idle, still answering
            print(f"rank {R}: SKIPPED", flush=True)
    else:
        specs = [t.TensorSpec("early", 10, "float32"), t.TensorSpec("late", 10, "float32")]
        f = t.FusedAllreduce(specs, threshold_bytes=0)
        f.submit(0, np.ones(10, np.float32))
        if R != N - 1:
            f.submit(1, np.ones(10, np.float32))
        f.wait()
    print(f"rank {R}: NO ERROR", flush=True)
except t.StallError as e:
    print(f"rank {R}: STALL after {time.perf_counter() - start:.1f}s: {e}", flush=True)
    # Later collectives fail at once instead of waiting again.
    try:
        t.barrier()
    except t.CommError as again:
        print(f"rank {R}: THEN {again}"[:200], flush=True)
sys.stdout.flush()
time.sleep(1)  # let the other rank print before the job is torn down
t.abort(3)  # after a stall MPI cannot shut down cleanly: end the job explicitly
