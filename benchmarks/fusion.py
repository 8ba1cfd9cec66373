"""Fusion threshold sweep on the ResNet-50 gradient set, next to the physical floor.

    mpirun -n 2 python benchmarks/fusion.py [--quick]

1. ResNet-50 gradient set (214 float32 tensors, 25.6 M values, in backprop order = the
   stored order reversed): one FusedAllreduce round (submit every tensor, wait) at
   thresholds 0, 32 KB, 1 MB, 8 MB, 64 MB; next to it the floor: one contiguous
   MPI_Allreduce (mpi4py) of the same bytes, and one memcpy of the same bytes (the engine
   copies every gradient into its bucket buffer once). Variants are timed round-robin in
   every repetition, so load drift hits them alike.
2. memcpy bandwidth per message size (1 KB .. 256 MB), the floor drawn beside the busbw
   curves of allreduce.py.

Every time is the median over repetitions of the slowest rank's time. Rank 0 writes
results/fusion.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import benchlib as bl
import mpi4py
import numpy as np

mpi4py.rc.initialize = False  # tnt_comm initialises MPI (THREAD_MULTIPLE, its own thread)
mpi4py.rc.finalize = False
import tnt_comm as t  # noqa: E402

t.init()
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
SWEEP_KB = (0, 32, 1024, 8192, 65536)


def slowest(fn: Callable[[], object]) -> float:
    COMM.Barrier()
    t0 = time.perf_counter()
    fn()
    return COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def gradient_set_sweep(shapes: list[list[int]], reps: int) -> dict:
    shapes = list(reversed(shapes))  # backprop hands the last layer's gradient first
    specs = [t.TensorSpec(f"g{i}", int(np.prod(s)), "float32") for i, s in enumerate(shapes)]
    grads = [np.full(s.count, 0.5, np.float32) for s in specs]
    total = sum(s.count for s in specs)
    flat = np.full(total, 0.5, np.float32)
    flat_out = np.empty_like(flat)
    engines = {kb: t.FusedAllreduce(specs, kb * 1024) for kb in SWEEP_KB}

    def fused(engine: t.FusedAllreduce) -> Callable[[], object]:
        plan = engine.plan

        def round_() -> object:  # as tnt-keras runs it: one submit_many per bucket
            for bucket in plan:
                engine.submit_many(bucket, [grads[i] for i in bucket])
            return engine.wait_buckets()
        return round_

    variants: dict[str, Callable[[], object]] = {f"fused@{kb}": fused(e) for kb, e in engines.items()}
    variants["floor_allreduce"] = lambda: COMM.Allreduce(flat, flat_out, op=MPI.SUM)
    variants["memcpy"] = lambda: np.copyto(flat_out, flat)
    for fn in variants.values():  # warm-up
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for k, fn in variants.items():
            times[k].append(slowest(fn))
    res = fused(engines[8192])()
    assert all(np.all(r == 0.5 * COMM.size) for r in res), "wrong fused result"
    med = {k: bl.median(v) for k, v in times.items()}
    mins = {k: min(v) for k, v in times.items()}
    floor = med["floor_allreduce"]
    rows = [{"threshold_kb": kb, "buckets": len(engines[kb].plan), "fused_s": med[f"fused@{kb}"],
             "over_floor": med[f"fused@{kb}"] / floor,
             "over_floor_plus_memcpy": med[f"fused@{kb}"] / (floor + med["memcpy"])}
            for kb in SWEEP_KB]
    for e in engines.values():
        e.close()
    return {"tensors": len(specs), "values": total, "bytes": 4 * total, "reps": reps,
            "floor_allreduce_s": floor, "memcpy_s": med["memcpy"],
            "floor_allreduce_min_s": mins["floor_allreduce"], "memcpy_min_s": mins["memcpy"],
            "fused_min_s": {kb: mins[f"fused@{kb}"] for kb in SWEEP_KB}, "sweep": rows}


def memcpy_bandwidth(max_bytes: int, reps: int) -> list[dict]:
    rows = []
    nbytes = 1 << 10
    while nbytes <= max_bytes:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        k = max(3, reps if nbytes <= 1 << 20 else reps // 4)
        for _ in range(2):
            np.copyto(dst, src)
        ts = []
        for _ in range(k):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            ts.append(time.perf_counter() - t0)
        s = bl.median(ts)
        rows.append({"bytes": nbytes, "memcpy_s": s, "memcpy_GBps": nbytes / s / 1e9})
        nbytes *= 4
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    t0 = time.perf_counter()
    before = bl.machine()
    shapes = json.loads((bl.HERE / "data" / "resnet50_trainable_shapes.json").read_text())["shapes"]
    gs = gradient_set_sweep(shapes, 5 if args.quick else 11)
    mem = memcpy_bandwidth((64 if args.quick else 256) << 20, 20)
    result = {"ranks": COMM.size, "machine_before": before, "machine_after": bl.machine(),
              "resnet50_set": gs, "memcpy": mem, "wall_s": time.perf_counter() - t0}
    if COMM.rank != 0:
        return
    print(f"\nResNet-50 gradient set on {COMM.size} ranks ({gs['bytes'] / 1e6:.1f} MB, "
          f"load {before['loadavg'][0]:.2f}): floor = one contiguous MPI_Allreduce "
          f"{gs['floor_allreduce_s'] * 1e3:.1f} ms, memcpy {gs['memcpy_s'] * 1e3:.1f} ms")
    print(f"{'threshold':>10} {'buckets':>7} {'fused ms':>9} {'/floor':>7} {'/(floor+memcpy)':>15}")
    for r in gs["sweep"]:
        print(f"{r['threshold_kb']:>7} KB {r['buckets']:7d} {r['fused_s'] * 1e3:9.1f} "
              f"{r['over_floor']:7.2f} {r['over_floor_plus_memcpy']:15.2f}")
    out = bl.RESULTS / "fusion.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
