"""An uncaught exception on one rank must end the job (MPI_Abort via tnt_comm's
excepthook) while the other ranks wait in a collective: no hang until the timeout."""

from __future__ import annotations

import os
import sys

import tnt_comm as t

sys.path.insert(0, os.path.dirname(__file__))
from _harness import watchdog

watchdog(60)
t.init()
if t.rank() == t.size() - 1:
    raise RuntimeError("boom from the last rank")
t.barrier()  # never completes: the last rank is gone
print("UNREACHABLE", flush=True)
