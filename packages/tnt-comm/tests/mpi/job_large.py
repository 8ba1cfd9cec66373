"""Transfers above MPI's int count limit (2^31-1 bytes) on 2 ranks: a broadcast of
2 GiB + a bit and an allgather whose result is as large. Checked slice by slice so the
job stays within a few GiB per rank."""

from __future__ import annotations

import os
import sys

import numpy as np

import tnt_comm as t

sys.path.insert(0, os.path.dirname(__file__))
from _harness import watchdog

watchdog(170)
R, N = t.rank(), t.size()
PERIOD = 4099  # a prime: a wrong offset anywhere shows up as a wrong pattern
base = (np.arange(PERIOD) % 251).astype(np.uint8)
rows = (2**31 + 2**20) // PERIOD + 1  # > 2^31 bytes


def check_pattern(a: np.ndarray, shift: int, what: str) -> None:
    view = a.reshape(-1, PERIOD)
    want = (base.astype(np.int32) + shift) % 256
    for start in range(0, view.shape[0], 16384):  # 64 MiB at a time
        block = view[start : start + 16384]
        assert (block == want.astype(np.uint8)).all(), f"{what}: wrong bytes in rows {start}.."


# Broadcast from the last rank: its pattern shifted by its rank.
x = np.tile(((base.astype(np.int32) + R) % 256).astype(np.uint8), rows) if R == N - 1 else np.empty(rows * PERIOD, np.uint8)
assert x.nbytes > 2**31
y = t.broadcast(x, root=N - 1)
del x
check_pattern(y, N - 1, "broadcast")
del y
print(f"rank {R}: BROADCAST OK", flush=True)

# Allgather: every rank half of it (total > 2^31 bytes), shifted by its rank.
half = rows // N + 1
mine = np.tile(((base.astype(np.int32) + R) % 256).astype(np.uint8), half)
z = t.allgather(mine)
del mine
assert z.nbytes == N * half * PERIOD and z.nbytes > 2**31
for r in range(N):
    check_pattern(z[r * half * PERIOD : (r + 1) * half * PERIOD], r, f"allgather part of rank {r}")
del z
print(f"rank {R}: ALLGATHER OK", flush=True)
t.barrier()
