"""Allreduce benchmark: tnt_comm vs mpi4py on the same MPI (run under mpirun).

    mpirun -n 2 python benchmarks/allreduce.py [--quick]

1. Bus bandwidth (nccl-tests: busbw = bytes * 2(n-1)/n / time), 1 KB .. 256 MB:
   tnt_comm.allreduce vs mpi4py Allreduce.
2. ResNet-50 gradient set (214 float32 tensors, 25.6 M values; shapes stored in
   benchmarks/data): FusedAllreduce vs one contiguous MPI_Allreduce of the same bytes
   (the floor) vs one allreduce per tensor.
3. 1000 tensors of 256 float32: fused vs one allreduce per tensor, and vs its physical
   bound (one contiguous MPI_Allreduce + one memcpy of the same bytes).
4. Latency: a 4 KiB fused bucket round (submit + wait) vs one MPI_Allreduce of 4 KiB,
   also with the last rank arriving 1 ms late (the communication thread is asleep by
   then); and a 4-byte tnt_comm.allreduce vs mpi4py's. Beside them, the floors of an
   engine built on non-blocking collectives: MPI_Iallreduce + a test loop (4 KiB), and
   the two of a checked 4 B allreduce (description check, then data).

"fused" is a round as tnt-keras runs it (submit_many per bucket, wait_buckets); the
same round with one submit() call and one result array per tensor is reported beside it.

Every time is the median over repetitions (after warm-up) of the slowest rank's time.
Prints a table; rank 0 writes benchmarks/results/allreduce.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import mpi4py
import numpy as np

# tnt_comm initialises MPI (from its own thread, with its defaults); mpi4py only uses it.
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False
from mpi4py import MPI  # noqa: E402

import tnt_comm as t  # noqa: E402

t.init()

HERE = Path(__file__).parent
COMM = MPI.COMM_WORLD
DEFAULT_THRESHOLD = 4 << 20  # bytes per fusion bucket (see the sweep in the JSON)
LATE_S = 1e-3  # how late the last rank arrives in the late-peer latency rounds


def timed(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median over reps of the slowest rank's wall time for one call of fn."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        COMM.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(COMM.allreduce(dt, op=MPI.MAX))
    return statistics.median(times)


def reps_for(nbytes: int) -> int:
    return 50 if nbytes <= 1 << 20 else 15 if nbytes <= 16 << 20 else 5


def busbw(max_bytes: int, quick: bool) -> list[dict[str, float]]:
    n = COMM.size
    rows = []
    nbytes = 1 << 10
    while nbytes <= max_bytes:
        x = np.ones(nbytes // 4, np.float32)
        out = np.empty_like(x)
        reps = max(3, reps_for(nbytes) // (3 if quick else 1))
        t_tnt = timed(lambda x=x: t.allreduce(x), reps)
        t_mpi = timed(lambda x=x, out=out: COMM.Allreduce(x, out), reps)
        factor = 2 * (n - 1) / n if n > 1 else 1.0
        rows.append({
            "bytes": nbytes,
            "tnt_s": t_tnt,
            "mpi4py_s": t_mpi,
            "tnt_GBps": nbytes * factor / t_tnt / 1e9,
            "mpi4py_GBps": nbytes * factor / t_mpi / 1e9,
        })
        nbytes *= 4
    return rows


def small_bucket_latency(reps: int) -> dict[str, float]:
    """4 KiB bucket (1024 float32): one fused round vs one MPI_Allreduce of the bytes;
    with the last rank late by LATE_S, that delay is subtracted from both."""
    x = np.ones(1024, np.float32)
    out = np.empty_like(x)
    late = COMM.rank == COMM.size - 1

    def delayed(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            if late:
                time.sleep(LATE_S)
            return fn()
        return run

    with t.FusedAllreduce([t.TensorSpec("g", 1024, "float32")], 1 << 20) as f:
        def fused() -> object:
            f.submit(0, x)
            return f.wait_buckets()

        def mpi() -> object:
            return COMM.Allreduce(x, out)

        def mpi_nonblocking() -> None:
            req = COMM.Iallreduce(x, out)
            while not req.Test():
                pass

        res = {"fused_s": timed(fused, reps), "mpi4py_s": timed(mpi, reps),
               "mpi4py_nonblocking_s": timed(mpi_nonblocking, reps)}
        res["fused_late_peer_s"] = timed(delayed(fused), reps // 2) - LATE_S
        res["mpi4py_late_peer_s"] = timed(delayed(mpi), reps // 2) - LATE_S
    one = np.ones(1, np.float32)
    one_out = np.empty_like(one)
    res["plain_4B_s"] = timed(lambda: t.allreduce(one), reps)
    res["mpi4py_4B_s"] = timed(lambda: COMM.Allreduce(one, one_out), reps)
    check, check_out = np.zeros(4, np.int64), np.empty(4, np.int64)

    def checked_nonblocking() -> None:
        """The floor of a checked plain allreduce built on non-blocking MPI: the
        description check (4 int64, MAX) and the data, each an MPI_Iallreduce + test loop."""
        for buf, res_buf, op in ((check, check_out, MPI.MAX), (one, one_out, MPI.SUM)):
            req = COMM.Iallreduce(buf, res_buf, op)
            while not req.Test():
                pass

    res["mpi4py_checked_nonblocking_4B_s"] = timed(checked_nonblocking, reps)
    return res


def fused_round(engine: t.FusedAllreduce, grads: list[np.ndarray]) -> list[np.ndarray]:
    """One round as tnt-keras runs it: each bucket's tensors in one submit_many call,
    results one flat array per bucket (split into tensors by the caller, here by views)."""
    indices = range(len(grads))
    engine.submit_many(indices, grads)
    return engine.wait_buckets()


def fused_round_per_call(engine: t.FusedAllreduce, grads: list[np.ndarray]) -> list[np.ndarray]:
    """The same round with one submit() call per tensor and one result array per tensor."""
    for i, g in enumerate(grads):
        engine.submit(i, g)
    return engine.wait()


def gradient_set(shapes: list[list[int]], threshold: int, reps: int) -> dict[str, float]:
    specs = [t.TensorSpec(f"g{i}", int(np.prod(s)), "float32") for i, s in enumerate(shapes)]
    grads = [np.full(s.count, 0.5, np.float32) for s in specs]
    total = sum(s.count for s in specs)
    flat = np.full(total, 0.5, np.float32)
    flat_out = np.empty_like(flat)
    with t.FusedAllreduce(specs, threshold) as fused, t.FusedAllreduce(specs, 0) as per_tensor:
        res = {
            "tensors": len(specs),
            "values": total,
            "threshold_bytes": threshold,
            "buckets": len(fused.plan),
            "fused_s": timed(lambda: fused_round(fused, grads), reps),
            "fused_per_call_s": timed(lambda: fused_round_per_call(fused, grads), reps),
            "floor_s": timed(lambda: COMM.Allreduce(flat, flat_out), reps),
            "per_tensor_engine_s": timed(lambda: fused_round_per_call(per_tensor, grads), reps),
            "memcpy_s": timed(lambda: np.copyto(flat_out, flat), reps),
        }
        check = fused_round(fused, grads)
        assert all(np.all(c == 0.5 * COMM.size) for c in check), "wrong fused result"
        assert sum(c.size for c in check) == total, "fused result has the wrong size"
        check = fused_round_per_call(fused, grads)
        assert all(np.all(c == 0.5 * COMM.size) for c in check), "wrong fused result (per call)"
    outs = [np.empty_like(g) for g in grads]

    def mpi4py_per_tensor() -> None:
        for g, o in zip(grads, outs):
            COMM.Allreduce(g, o)

    # "One allreduce per tensor": the MPI library's own Allreduce, once per tensor.
    res["per_tensor_s"] = timed(mpi4py_per_tensor, reps)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions, sizes up to 64 MB")
    p.add_argument("--threshold", type=int, default=DEFAULT_THRESHOLD, help="fusion bytes")
    p.add_argument("--out", type=Path, default=HERE / "results" / "allreduce.json")
    args = p.parse_args()

    rank, n = t.rank(), t.size()
    shapes = json.loads((HERE / "data" / "resnet50_trainable_shapes.json").read_text())["shapes"]
    max_bytes = (64 if args.quick else 256) << 20
    reps = 5 if args.quick else 10

    bw = busbw(max_bytes, args.quick)
    resnet = gradient_set(shapes, args.threshold, reps)
    small = gradient_set([[256]] * 1000, args.threshold, reps * 3)
    latency = small_bucket_latency(200 if args.quick else 1000)
    sweep = []
    for thr in (1 << 20, 16 << 20, 64 << 20):
        r = gradient_set(shapes, thr, max(3, reps // 2))
        sweep.append({k: r[k] for k in ("threshold_bytes", "buckets", "fused_s", "floor_s")})

    large = [r for r in bw if r["bytes"] >= 1 << 20]
    worst_ratio = min(r["tnt_GBps"] / r["mpi4py_GBps"] for r in large) if large else float("nan")
    result = {
        "ranks": n,
        "mpi": t._runtime._core.library_version(),
        "poll": {k: os.environ.get(k, "default") for k in
                 ("TNT_COMM_POLL_SPIN_US", "TNT_COMM_POLL_MAX_SLEEP_US")},
        "busbw": [{k: r[k] for k in ("bytes", "tnt_GBps", "mpi4py_GBps", "tnt_s", "mpi4py_s")}
                  for r in bw],
        "resnet50_set": resnet,
        "small_tensors": small,
        "latency": latency,
        "resnet50_threshold_sweep": sweep,
        "targets": {
            "small_bucket_latency_vs_mpi": latency["fused_s"] / latency["mpi4py_s"],
            "small_bucket_latency_late_peer_vs_mpi": latency["fused_late_peer_s"] / latency["mpi4py_late_peer_s"],
            "small_tensors_fused_vs_floor_plus_memcpy": small["fused_s"] / (small["floor_s"] + small["memcpy_s"]),
            "plain_allreduce_4B_vs_mpi4py": latency["plain_4B_s"] / latency["mpi4py_4B_s"],
            # The floors of an engine built on non-blocking collectives (one thread owns
            # the requests, so nothing blocks inside MPI), measured in the same run:
            "small_bucket_nonblocking_floor_vs_mpi": latency["mpi4py_nonblocking_s"] / latency["mpi4py_s"],
            "plain_4B_checked_nonblocking_floor_vs_mpi4py":
                latency["mpi4py_checked_nonblocking_4B_s"] / latency["mpi4py_4B_s"],
            "resnet50_fused_over_floor": resnet["fused_s"] / resnet["floor_s"],
            "resnet50_within_15pct": resnet["fused_s"] <= 1.15 * resnet["floor_s"],
            "small_speedup_vs_per_tensor": small["per_tensor_s"] / small["fused_s"],
            "small_at_least_10x": small["per_tensor_s"] >= 10 * small["fused_s"],
            "small_speedup_vs_engine_per_tensor": small["per_tensor_engine_s"] / small["fused_s"],
            "small_speedup_per_call_api_vs_per_tensor": small["per_tensor_s"] / small["fused_per_call_s"],
            "busbw_worst_ratio_ge_1MB": worst_ratio,
            "busbw_at_least_95pct_ge_1MB": worst_ratio >= 0.95,
        },
    }
    if rank == 0:
        print(f"\nallreduce benchmark, {n} ranks, {result['mpi']}")
        print(f"{'bytes':>11} {'tnt GB/s':>9} {'mpi4py GB/s':>11} {'ratio':>6}")
        for r in bw:
            print(f"{r['bytes']:>11} {r['tnt_GBps']:>9.3f} {r['mpi4py_GBps']:>11.3f} "
                  f"{r['tnt_GBps'] / r['mpi4py_GBps']:>6.2f}")
        for name, res in (("ResNet-50 set", resnet), ("1000 x 256 float32", small)):
            print(f"\n{name}: {res['tensors']} tensors, {res['values']} values, "
                  f"{res['buckets']} buckets at {res['threshold_bytes']} B")
            print(f"  fused (submit_many + wait_buckets)      {res['fused_s'] * 1e3:9.2f} ms")
            print(f"  fused (submit + wait, per tensor calls) {res['fused_per_call_s'] * 1e3:9.2f} ms")
            print(f"  floor (1 contiguous mpi4py Allreduce)   {res['floor_s'] * 1e3:9.2f} ms")
            print(f"  per tensor (mpi4py Allreduce each)      {res['per_tensor_s'] * 1e3:9.2f} ms")
            print(f"  per tensor (tnt engine, threshold 0)    {res['per_tensor_engine_s'] * 1e3:9.2f} ms")
        lat = latency
        print(f"\nlatency (us): 4 KiB fused round {lat['fused_s'] * 1e6:.1f} vs MPI_Allreduce "
              f"{lat['mpi4py_s'] * 1e6:.1f}; last rank {LATE_S * 1e3:.0f} ms late (delay subtracted): "
              f"{lat['fused_late_peer_s'] * 1e6:.1f} vs {lat['mpi4py_late_peer_s'] * 1e6:.1f}; "
              f"4 B tnt_comm.allreduce {lat['plain_4B_s'] * 1e6:.1f} vs mpi4py {lat['mpi4py_4B_s'] * 1e6:.1f}")
        print(f"  non-blocking floors (mpi4py Iallreduce + Test loop): 4 KiB "
              f"{lat['mpi4py_nonblocking_s'] * 1e6:.1f}; 4 B check + data "
              f"{lat['mpi4py_checked_nonblocking_4B_s'] * 1e6:.1f}")
        print("\nResNet-50 set, other thresholds (fused / floor):")
        for r in sweep:
            print(f"  {r['threshold_bytes'] >> 20:4d} MiB, {r['buckets']:3d} buckets: "
                  f"{r['fused_s'] * 1e3:8.2f} / {r['floor_s'] * 1e3:8.2f} ms")
        print("\ntargets:", json.dumps(result["targets"], indent=1))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
