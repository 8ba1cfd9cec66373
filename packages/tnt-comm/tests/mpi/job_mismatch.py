"""Rank 0 runs a plain allreduce where the other ranks run a fused bucket: MPI matches
the two collectives against each other and fails; the error must say that the ranks ran
different collectives, and the job must end (uncaught error -> MPI_Abort)."""

from __future__ import annotations

import os
import sys

import numpy as np

import tnt_comm as t

sys.path.insert(0, os.path.dirname(__file__))
from _harness import watchdog

watchdog(60)
t.init()
t.barrier()
if t.rank() == 0:
    t.allreduce(np.ones(4, np.float32))  # e.g. a "global" metric computed under `if rank == 0`
else:
    with t.FusedAllreduce([t.TensorSpec("grad", 1000, "float32")], threshold_bytes=0) as f:
        f.submit(0, np.ones(1000, np.float32))
        f.wait()
t.barrier()
print("UNREACHABLE", flush=True)
