"""Rank N-1 ends early (sys.exit(CODE), or its script just returns) while the other
ranks wait in a collective: they must fail at once naming the rank that left, and the
job must end (its uncaught error aborts it) instead of waiting for TNT_COMM_TIMEOUT."""

from __future__ import annotations

import os
import sys

import tnt_comm as t

sys.path.insert(0, os.path.dirname(__file__))
from _harness import watchdog

watchdog(60)
t.init()
t.barrier()
if t.rank() == t.size() - 1:
    code = int(os.environ["CODE"])
    if code:
        sys.exit(code)
else:
    t.barrier()  # never completes: the last rank has left
    print("UNREACHABLE", flush=True)
