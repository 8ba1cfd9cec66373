"""Sparse gradients: the exact exchange (allgather of slices) against a dense allreduce.

    mpirun -n 2 python benchmarks/sparse_exchange.py [--quick]

An Embedding's gradient is k slices (one per token of the rank's micro-batch) of a V x d
table. tnt gathers every rank's slices (what serial Keras' optimizer sees, exact for Adam);
``TNT_SPARSE_AS_DENSE=1`` densifies and SUM-allreduces the V x d table instead (Horovod's
``sparse_as_dense``: not serial Keras' update for Adam-like optimizers). This times both
exchanges with tnt_comm's own collectives, on GPT-2's token table (V = 50257, d = 768,
float32 values, int32 indices) for several tokens per rank, medians of repeated calls:

    row sparse_exchange_<k>_tokens: allgather time / dense allreduce time (< 1: gather cheaper)

Volume per rank: the gather receives N k (4 d + 4) bytes; a ring/recursive allreduce moves
about 2 (N - 1) / N x 4 V d. Measured on 2 ranks (docs/benchmarks.md, "Sparse gradients"):
the gather breaks even at about 16 k tokens per rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import tnt_comm

VOCAB, WIDTH = 50257, 768
RESULTS = Path(__file__).parent / "results"


def _median_seconds(fn, reps: int) -> float:
    fn()  # warm-up: buffers, first-touch of the output
    times = []
    for _ in range(reps):
        tnt_comm.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # The slowest rank decides when a step can go on.
    return statistics.median(max(t) for t in zip(*tnt_comm.allgather_object(times)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    args = parser.parse_args()
    reps = 3 if args.quick else 7
    tokens = [2048, 16384] if args.quick else [512, 2048, 8192, 16384, 32768]
    rng = np.random.default_rng(tnt_comm.rank())
    table = rng.normal(size=(VOCAB, WIDTH)).astype(np.float32)
    dense = _median_seconds(lambda: tnt_comm.allreduce(table), reps)
    rows = {}
    for k in tokens:
        indices = rng.integers(0, VOCAB, size=k).astype(np.int32)
        values = rng.normal(size=(k, WIDTH)).astype(np.float32)
        gather = _median_seconds(lambda i=indices, v=values: (tnt_comm.allgather(i), tnt_comm.allgather(v)), reps)
        rows[f"sparse_exchange_{k}_tokens"] = {
            "gather_s": gather, "dense_allreduce_s": dense, "ratio": gather / dense,
            "gathered_bytes": tnt_comm.size() * k * (4 * WIDTH + 4), "dense_bytes": 4 * VOCAB * WIDTH,
        }
    if tnt_comm.rank() == 0:
        print(f"sparse exchange on {tnt_comm.size()} ranks, GPT-2 token table {VOCAB} x {WIDTH} "
              f"(dense allreduce {dense * 1e3:.1f} ms, median of {reps})")
        print(f"{'tokens per rank':>16} {'gathered MB':>12} {'gather ms':>10} {'gather / dense':>15}")
        for k in tokens:
            r = rows[f"sparse_exchange_{k}_tokens"]
            print(f"{k:16d} {r['gathered_bytes'] / 1e6:12.1f} {r['gather_s'] * 1e3:10.1f} {r['ratio']:15.3f}")
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "sparse_exchange.json").write_text(
            json.dumps({"ranks": tnt_comm.size(), "vocab": VOCAB, "width": WIDTH, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
