"""Every collective and the fused engine on however many ranks mpirun gave us.

Expected values are built independently with numpy from the known per-rank inputs.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ml_dtypes
import numpy as np
from _harness import check, run_all, watchdog

import tnt_comm as t

watchdog()
R, N = t.rank(), t.size()
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.int64]
RANK_SUM = N * (N + 1) // 2  # sum over ranks of (r + 1)


def contribution(n: int, dtype: object, r: int) -> np.ndarray:
    """Rank r's data: (i % 13) * (r + 1), exact in every dtype for these sizes."""
    return ((np.arange(n) % 13) * (r + 1)).astype(dtype)


def expect_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if got.dtype.kind in "fV":  # floats incl. bfloat16: compare as float64, NaN == NaN
        ok = np.array_equal(got.astype(np.float64), want.astype(np.float64), equal_nan=True)
    else:
        ok = np.array_equal(got, want)
    assert ok, f"{what}: values differ, first got {got.ravel()[:5]} want {want.ravel()[:5]}"


def expect_raises(exc: type[BaseException], fragment: str, fn, *args, **kw) -> None:
    try:
        fn(*args, **kw)
    except exc as e:
        assert fragment in str(e), f"message {str(e)!r} lacks {fragment!r}"
        return
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__} ({fragment})")


@check
def world() -> None:
    assert 0 <= R < N
    assert t.local_size() == N  # one host
    assert t.local_rank() == R
    ranks = t.allgather(np.array([R], np.int64))
    expect_equal(ranks, np.arange(N, dtype=np.int64), "ranks")


@check
def allreduce_sum_every_dtype_and_size() -> None:
    for dtype in DTYPES:
        itemsize = np.dtype(dtype).itemsize
        large = (16 * 2**20) // itemsize + 7  # > 16 MB, odd
        for n in (0, 1, 7, 1001, large):
            x = contribution(n, dtype, R)
            want = ((np.arange(n) % 13) * RANK_SUM).astype(dtype)
            expect_equal(t.allreduce(x), want, f"sum {np.dtype(dtype).name}[{n}]")
            expect_equal(x, contribution(n, dtype, R), "input untouched")


@check
def allreduce_shapes_min_max_avg() -> None:
    x = contribution(24, np.float32, R).reshape(2, 3, 4)
    s = t.allreduce(x, t.Op.SUM)
    assert s.shape == (2, 3, 4)
    base = (np.arange(24) % 13).reshape(2, 3, 4)
    expect_equal(t.allreduce(x, t.Op.MIN), base.astype(np.float32), "min")
    expect_equal(t.allreduce(x, t.Op.MAX), (base * N).astype(np.float32), "max")
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        avg = t.allreduce(contribution(30, dtype, R), t.Op.AVG)
        want = (np.arange(30) % 13) * RANK_SUM / N
        assert np.allclose(avg.astype(np.float64), want, rtol=1e-2), (dtype, avg)
    for dtype in (np.int32, np.int64, np.float16, ml_dtypes.bfloat16):
        expect_equal(t.allreduce(contribution(9, dtype, R), t.Op.MAX),
                     ((np.arange(9) % 13) * N).astype(dtype), f"max {np.dtype(dtype).name}")
    scalar = t.allreduce(np.array(R + 1.0))
    assert scalar.shape == () and float(scalar) == RANK_SUM


@check
def avg_of_16_bit_floats_scales_before_summing() -> None:
    # The sum of N copies of 60000 overflows float16 (max 65504); the mean does not.
    for dtype in (np.float16, ml_dtypes.bfloat16):
        got = t.allreduce(np.full(5, 60000, dtype), t.Op.AVG).astype(np.float64)
        assert np.allclose(got, 60000, rtol=1e-2), (dtype, got)
    specs = [t.TensorSpec("h", 7, np.float16), t.TensorSpec("b", 3, ml_dtypes.bfloat16)]
    with t.FusedAllreduce(specs, 1024, op=t.Op.AVG) as f:
        f.submit(0, np.full(7, 60000, np.float16))
        f.submit(1, np.full(3, 3e38, ml_dtypes.bfloat16))
        h, b = f.wait()
    assert np.allclose(h.astype(np.float64), 60000, rtol=1e-2), h
    assert np.allclose(b.astype(np.float64), 3e38, rtol=2e-2), b


@check
def nan_and_inf_from_one_rank_propagate() -> None:
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        x = np.ones(5, dtype)
        if R == N - 1:
            x[1], x[2], x[3] = np.nan, np.inf, -np.inf
        y = t.allreduce(x).astype(np.float64)
        assert np.isnan(y[1]) and y[2] == np.inf and y[3] == -np.inf, (dtype, y)
        assert y[0] == N and y[4] == N


@check
def every_rank_holds_the_same_bits_small_and_large() -> None:
    """Small messages are reduced point-to-point (Note [Small allreduce]), larger ones by
    MPI: on both sides of the 64 KiB switch every rank must hold the same bits, also
    where the operand order decides them (rounding of random sums, MIN over NaN/±0)."""
    rng = np.random.default_rng(100 + R)
    for n in (1, 1000, 16384, 16385):  # 16384 float32 = 64 KiB: the last point-to-point size
        x = rng.standard_normal(n).astype(np.float32)
        got = t.allreduce(x)
        want = t.allgather(x.astype(np.float64).reshape(1, n)).sum(axis=0)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5), (n, got[:3], want[:3])
        bits = t.allgather(got.view(np.uint32).reshape(1, n))
        assert (bits == bits[0]).all(), f"sum of float32[{n}]: ranks hold different bits"
        y = np.where(np.arange(n) % 2 == R % 2, -0.0, 0.0).astype(np.float32)
        if R == N - 1:
            y[::3] = np.nan
        low = t.allreduce(y, t.Op.MIN)
        bits = t.allgather(low.view(np.uint32).reshape(1, n))
        assert (bits == bits[0]).all(), f"MIN of float32[{n}] with NaN/±0: ranks hold different bits"
        # (MPI leaves MIN over NaN unspecified: a zero or a NaN, but the same everywhere)
        assert (low == 0).sum() + np.isnan(low).sum() == n, (n, low[:6])


@check
def broadcast_from_first_and_last_rank() -> None:
    for root in sorted({0, N - 1}):
        for dtype in (*DTYPES, np.uint8, np.bool_, np.complex64):
            x = (np.arange(12).reshape(3, 4) + 100 * R).astype(dtype)
            want = (np.arange(12).reshape(3, 4) + 100 * root).astype(dtype)
            expect_equal(t.broadcast(x, root=root), want, f"bcast root {root} {np.dtype(dtype)}")
        expect_equal(t.broadcast(np.zeros(0, np.float32), root), np.zeros(0, np.float32), "empty")
        big = np.full(5_000_000, R, np.float32)
        expect_equal(t.broadcast(big, root), np.full(5_000_000, root, np.float32), "bcast 20MB")


@check
def allgather_uneven_lengths() -> None:
    rows = t.allgather(np.full((R, 3), R, np.float64))  # rank 0 contributes nothing
    want = np.concatenate([np.full((r, 3), r, np.float64) for r in range(N)])
    expect_equal(rows, want, "allgather uneven 2-D")
    flat = t.allgather(np.arange(R + 1, dtype=np.int32))
    expect_equal(flat, np.concatenate([np.arange(r + 1, dtype=np.int32) for r in range(N)]), "1-D")
    none = t.allgather(np.zeros((0, 2), np.float32))
    assert none.shape == (0, 2)


def large_contribution(start: int, n: int, dtype: object, r: int) -> np.ndarray:
    """Rank r's elements start..start+n of a large array: (i % 61) + 64 r + 1. Exact in every
    dtype summed over 4 ranks (< 2048); the prime period and the rank's offset make a block
    taken at a wrong offset, a peer's contribution dropped, doubled or swapped change sums."""
    return ((np.arange(start, start + n) % 61) + 64 * r + 1).astype(dtype)


@check
def reduce_scatter_and_allgather_large_uneven_counts() -> None:
    # Above 64 KiB: Note [Pairwise reduce-scatter] in mpi_transport.cc (below it, MPI's own).
    unit = 20011  # elements; neither it nor the sums below are multiples of 61
    patterns = [[unit * (r + 1) + r for r in range(N)],      # every rank a different count
                [0] + [unit + 7 * r for r in range(1, N)],    # rank 0 owns nothing
                [2 * unit + 3] + [0] * (N - 1)]               # rank 0 owns it all (level 2's bucket)
    if N >= 3:
        patterns.append([unit if r != 1 else 0 for r in range(N)])  # a middle rank owns nothing
    for dtype in (np.float32, np.int32, np.float16):
        for counts in patterns:
            n = sum(counts)
            start = sum(counts[:R])
            x = large_contribution(0, n, dtype, R)
            want = sum(large_contribution(start, counts[R], np.int64, r) for r in range(N)).astype(dtype)
            what = f"reduce_scatter {np.dtype(dtype).name} {counts}"
            got = t.reduce_scatter(x, counts)
            expect_equal(got, want, what)
            expect_equal(x, large_contribution(0, n, dtype, R), what + ": input untouched")
            whole = t.allgather(got)
            expect_equal(whole, sum(large_contribution(0, n, np.int64, r) for r in range(N)).astype(dtype),
                         f"allgather {np.dtype(dtype).name} {counts}")
    counts = patterns[0]
    n, start = sum(counts), sum(counts[:R])
    x = large_contribution(0, n, np.int64, R)
    expect_equal(t.reduce_scatter(x, counts, op=t.Op.MIN), large_contribution(start, counts[R], np.int64, 0),
                 "reduce_scatter large min")
    expect_equal(t.reduce_scatter(x, counts, op=t.Op.MAX),
                 large_contribution(start, counts[R], np.int64, N - 1), "reduce_scatter large max")
    avg = t.reduce_scatter(x.astype(np.float64), counts, op=t.Op.AVG)
    expect_equal(avg, sum(large_contribution(start, counts[R], np.float64, r) for r in range(N)) / N,
                 "reduce_scatter large avg")
    # Inexact float32 sums: the same bits on every call (one fixed reduction order).
    noise = np.random.default_rng(R).normal(size=n).astype(np.float32)
    first = t.reduce_scatter(noise, counts)
    for _ in range(3):
        assert np.array_equal(t.reduce_scatter(noise, counts), first), "reduce_scatter not deterministic"


@check
def reduce_scatter_every_dtype_uneven_counts() -> None:
    for dtype in DTYPES:
        for counts in ([r + 1 for r in range(N)], [0] * (N - 1) + [5], [3 * N + 1 - r for r in range(N)]):
            n = sum(counts)
            x = contribution(n, dtype, R)
            want_all = ((np.arange(n) % 13) * RANK_SUM).astype(dtype)
            start = sum(counts[:R])
            got = t.reduce_scatter(x, counts)
            expect_equal(got, want_all[start:start + counts[R]], f"reduce_scatter {np.dtype(dtype).name} {counts}")
            expect_equal(x, contribution(n, dtype, R), "input untouched")


@check
def reduce_scatter_rows_default_split_ops_and_groups() -> None:
    x = contribution(7 * 3, np.float64, R).reshape(7, 3)
    base = (np.arange(21) % 13).reshape(7, 3)
    rows = np.array_split(np.arange(7), N)[R]  # the default split: np.array_split's
    expect_equal(t.reduce_scatter(x), (base * RANK_SUM).astype(np.float64)[rows], "rows, default split")
    expect_equal(t.reduce_scatter(x, op=t.Op.MAX), (base * N).astype(np.float64)[rows], "max")
    expect_equal(t.reduce_scatter(x, op=t.Op.MIN), base.astype(np.float64)[rows], "min")
    expect_equal(t.reduce_scatter(x, op=t.Op.AVG), (base * RANK_SUM / N)[rows], "avg")
    big = np.full(3 * 2**20 + N, R + 1, np.float32)  # > 12 MB
    part = t.reduce_scatter(big)
    expect_equal(part, np.full(part.shape[0], RANK_SUM, np.float32), "large")
    half = t.world().split(R % 2, R)  # a sub-communicator: its own ranks and counts
    y = np.full(4 * half.size, R, np.int64)
    members = [r for r in range(N) if r % 2 == R % 2]
    expect_equal(half.reduce_scatter(y), np.full(4, sum(members), np.int64), "sub-communicator")


@check
def reduce_scatter_errors_on_every_rank() -> None:
    expect_raises(ValueError, "counts must hold one non-negative element count per rank",
                  t.reduce_scatter, np.zeros(5, np.float32), [6] + [0] * (N - 1))
    expect_raises(ValueError, "at least one dimension", t.reduce_scatter, np.asarray(np.float32(1.0)))
    expect_raises(TypeError, "counts must be integers", t.reduce_scatter, np.zeros(2, np.float32), [1.5] * N)
    if N > 1:
        counts = [2] * N
        counts[R % 2] += 1  # the same total, other splits on different ranks
        counts[(R + 1) % 2] -= 1
        expect_raises(ValueError, "differ across ranks", t.reduce_scatter, np.zeros(2 * N, np.float32), counts)
        expect_raises(ValueError, "differ across ranks", t.reduce_scatter, np.zeros(2 * N + R, np.float32))
    expect_equal(t.allreduce(np.ones(3)), np.full(3, float(N)), "usable after errors")


@check
def objects() -> None:
    got = t.broadcast_object({"from": R, "list": list(range(R))}, root=N - 1)
    assert got == {"from": N - 1, "list": list(range(N - 1))}
    assert t.allgather_object(("r", R, "x" * R)) == [("r", r, "x" * r) for r in range(N)]


@check
def cross_rank_mismatch_is_a_clear_error_everywhere() -> None:
    if N == 1:
        return
    # Every rank raises the same ValueError; afterwards the communicator still works.
    n = 4 if R == 0 else 3
    expect_raises(ValueError, "differ across ranks", t.broadcast, np.zeros(n, np.float32), 0)
    dt = np.float32 if R == 0 else np.float64
    expect_raises(ValueError, "differ across ranks", t.allreduce, np.zeros(4, dt))
    expect_raises(ValueError, "differ across ranks", t.allreduce, np.zeros(4, np.float32),
                  t.Op.SUM if R else t.Op.MAX)
    expect_raises(ValueError, "trailing dimensions", t.allgather, np.zeros((1, 2 + R), np.float32))
    expect_raises(ValueError, "disagree on the root", t.broadcast, np.zeros(2), R)
    expect_equal(t.allreduce(np.ones(3)), np.full(3, float(N)), "usable after errors")


def _specs(count: int, seed: int = 7) -> list[t.TensorSpec]:
    rng = np.random.default_rng(seed)  # same on every rank
    kinds = ["float32", "float64", "float16", "int64", "bfloat16"]
    return [t.TensorSpec(f"g{i}", int(rng.integers(0, 300)), kinds[int(rng.integers(0, 5))])
            for i in range(count)]


def _value(spec: t.TensorSpec, i: int, r: int, it: int = 0) -> np.ndarray:
    return (((np.arange(spec.count) + i + it) % 11) * (r + 1)).astype(spec.dtype)


def _want(spec: t.TensorSpec, i: int, it: int = 0) -> np.ndarray:
    return (((np.arange(spec.count) + i + it) % 11) * RANK_SUM).astype(spec.dtype)


@check
def fused_any_submission_order() -> None:
    specs = _specs(150)
    for threshold in (0, 1000, 1 << 20):
        with t.FusedAllreduce(specs, threshold) as f:
            assert f.plan == t.plan_buckets(specs, threshold)
            order = np.random.default_rng(100 + R).permutation(len(specs))  # differs per rank
            for i in order:
                f.submit(int(i), _value(specs[i], int(i), R))
            out = f.wait()
            assert len(out) == len(specs)
            for i, (s, y) in enumerate(zip(specs, out)):
                expect_equal(y, _want(s, i), f"fused {threshold} {s.name}")


@check
def fused_from_several_threads() -> None:
    specs = _specs(200, seed=3)
    with t.FusedAllreduce(specs, 4096) as f:
        order = np.random.default_rng(200 + R).permutation(len(specs))
        errors: list[BaseException] = []

        def worker(part: np.ndarray) -> None:
            try:
                for i in part:
                    f.submit(int(i), _value(specs[i], int(i), R))
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(p,)) for p in np.array_split(order, 4)]
        for th in threads:
            th.start()
        out = f.wait()  # may start before the threads are done
        for th in threads:
            th.join()
        assert not errors, errors
        for i, (s, y) in enumerate(zip(specs, out)):
            expect_equal(y, _want(s, i), f"threaded {s.name}")


@check
def fused_one_engine_100_rounds() -> None:
    specs = [t.TensorSpec(f"w{i}", c, "float32") for i, c in enumerate([94, 17, 2, 81, 0, 1000])]
    kept = None
    with t.FusedAllreduce(specs, 448, op=t.Op.SUM) as f:
        for it in range(100):
            for i in (reversed(range(len(specs))) if (R + it) % 2 else range(len(specs))):
                f.submit(i, _value(specs[i], i, R, it))
            out = f.wait()
            for i, (s, y) in enumerate(zip(specs, out)):
                expect_equal(y, _want(s, i, it), f"round {it} {s.name}")
            if it == 10:
                kept = out  # results held by the caller are never overwritten later
        for i, (s, y) in enumerate(zip(specs, kept)):
            expect_equal(y, _want(s, i, 10), f"kept round 10 {s.name}")


@check
def fused_avg_and_large() -> None:
    specs = [t.TensorSpec("big", 5_000_000, np.float32), t.TensorSpec("small", 3, np.float64)]
    with t.FusedAllreduce(specs, 1 << 22, op=t.Op.AVG) as f:
        f.submit(1, np.full(3, R, np.float64))
        f.submit(0, np.full(5_000_000, R + 1, np.float32))
        big, small = f.wait()
    assert np.all(big == np.float32(RANK_SUM / N)), big[:3]
    assert np.allclose(small, (N - 1) / 2)


@check
def fused_bad_submissions_name_the_tensor() -> None:
    specs = [t.TensorSpec("kernel", 4, "float32"), t.TensorSpec("bias", 2, "float32")]
    with t.FusedAllreduce(specs, 1024) as f:
        expect_raises(ValueError, "'kernel'", f.submit, 0, np.zeros(5, np.float32))
        expect_raises(TypeError, "'bias'", f.submit, 1, np.zeros(2, np.float64))
        expect_raises(ValueError, "ascontiguousarray", f.submit, 0, np.zeros(8, np.float32)[::2])
        expect_raises(IndexError, "not a tensor index", f.submit, 2, np.zeros(2, np.float32))
        f.submit(0, np.ones(4, np.float32))
        expect_raises(ValueError, "tensor 0 ('kernel') was already submitted", f.submit, 0,
                      np.ones(4, np.float32))
        f.submit(1, np.ones(2, np.float32))
        k, _b = f.wait()
        expect_equal(k, np.full(4, N, np.float32), "after errors")
    expect_raises(t.CommError, "closed", f.submit, 0, np.ones(4, np.float32))


@check
def fused_submit_many_and_wait_buckets() -> None:
    specs = _specs(300, seed=5)
    for threshold in (0, 700, 1 << 20):
        with t.FusedAllreduce(specs, threshold) as f:
            plan = f.plan
            for it in range(3):
                # Batches of different sizes, in a rank-dependent order, mixed with submit().
                order = [int(i) for i in np.random.default_rng(300 + R + it).permutation(len(specs))]
                single, batched = order[:7], order[7:]
                for i in single:
                    f.submit(i, _value(specs[i], i, R, it))
                for part in np.array_split(np.array(batched), 5):
                    idx = [int(i) for i in part]
                    f.submit_many(idx, [_value(specs[i], i, R, it) for i in idx])
                if it % 2:
                    out = f.wait()
                else:  # one flat array per bucket: its tensors back to back in plan order
                    buckets = f.wait_buckets()
                    assert len(buckets) == len(plan), (len(buckets), len(plan))
                    out = [None] * len(specs)
                    for members, flat in zip(plan, buckets):
                        counts = [specs[i].count for i in members]
                        assert flat.shape == (sum(counts),) and flat.dtype == specs[members[0]].dtype
                        for i, part in zip(members, np.split(flat, np.cumsum(counts)[:-1])):
                            out[i] = part
                for i, (s, y) in enumerate(zip(specs, out)):
                    expect_equal(y, _want(s, i, it), f"submit_many {threshold} round {it} {s.name}")


@check
def fused_submit_many_is_all_or_nothing() -> None:
    specs = [t.TensorSpec("kernel", 4, "float32"), t.TensorSpec("bias", 2, "float32"),
             t.TensorSpec("steps", 1, "int64")]
    with t.FusedAllreduce(specs, 1024) as f:
        good = [np.ones(4, np.float32), np.ones(2, np.float32), np.ones(1, np.int64)]
        expect_raises(ValueError, "'bias') has 2 elements", f.submit_many, [0, 1],
                      [good[0], np.ones(3, np.float32)])
        expect_raises(TypeError, "'steps') is int64 in the specs", f.submit_many, [0, 2],
                      [good[0], np.ones(1, np.float32)])
        expect_raises(TypeError, "must be a numpy.ndarray", f.submit_many, [1], [[1.0, 2.0]])
        expect_raises(ValueError, "not C-contiguous", f.submit_many, [0],
                      [np.ones(8, np.float32)[::2]])
        expect_raises(IndexError, "not a tensor index", f.submit_many, [0, 3], good[:2])
        expect_raises(ValueError, "2 indices but 3 arrays", f.submit_many, [0, 1], good)
        expect_raises(ValueError, "tensor 0 ('kernel') was already submitted", f.submit_many,
                      [0, 1, 0], [good[0], good[1], good[0]])
        # Nothing of the failed calls was taken: every tensor can still be submitted once.
        f.submit_many([2, 0, 1], [good[2], good[0], good[1]])
        k, b, st = f.wait()
        expect_equal(b, np.full(2, N, np.float32), "bias after failed batches")
        expect_equal(k, np.full(4, N, np.float32), "after failed batches")
        expect_equal(st, np.full(1, N, np.int64), "int64 after failed batches")


@check
def back_to_back_small_collectives_and_late_ranks() -> None:
    # The hand-off paths (Note [Hand-off]): calls that follow each other within the
    # spin windows, mixed with a fused round, and a rank that arrives late so the other
    # waits past the spins (sleeps). Every result is checked.
    with t.FusedAllreduce([t.TensorSpec("g", 1024, "float32")], 1 << 20) as f:
        for it in range(300):
            if it % 50 == 49 and R == it // 50 % N:
                time.sleep(0.003)  # this rank is late for this round
            got = t.allreduce(np.array([it * (R + 1)], np.int64))
            expect_equal(got, np.array([it * RANK_SUM], np.int64), f"4-byte allreduce {it}")
            f.submit(0, np.full(1024, it + R, np.float32))
            (b,) = f.wait_buckets()
            want = np.full(1024, N * it + N * (N - 1) // 2, np.float32)
            expect_equal(b, want, f"fused round {it}")


@check
def last_bucket_starts_without_a_waiter() -> None:
    # Note [Last bucket]: a round's last bucket is queued without waking the thread, for
    # the caller's wait() to drive. A caller that does not wait must not hold its peers:
    # the thread still starts it (within kIdleServiceInterval = 50 ms). The last rank
    # submits and does not wait until every other rank has reported (a file each) that its
    # own wait returned; the others must get there well within the bound.
    signals = Path(t.broadcast_object(tempfile.mkdtemp() if R == 0 else None))
    with t.FusedAllreduce([t.TensorSpec("g", 64, "float32")], 1 << 20) as f:
        for it in range(2):
            t.barrier()
            f.submit(0, np.full(64, R + it, np.float32))
            t0 = time.perf_counter()
            if R == N - 1:
                others = [signals / f"round{it}_rank{r}" for r in range(N - 1)]
                deadline = t0 + 5.0
                while not all(p.exists() for p in others):
                    assert time.perf_counter() < deadline, f"round {it}: peers still waiting after 5 s"
                    time.sleep(0.001)
            (b,) = f.wait_buckets()
            waited = time.perf_counter() - t0
            expect_equal(b, np.full(64, N * (N - 1) // 2 + N * it, np.float32), f"round {it}")
            if R != N - 1:
                assert waited < 0.35, f"round {it}: waited {waited:.3f} s for a peer that had submitted"
                (signals / f"round{it}_rank{R}").touch()
    t.barrier()
    if R == 0:
        shutil.rmtree(signals)


@check
def waiters_drive_while_other_threads_wait() -> None:
    # Note [Waiter drives]: three threads block at once, each on its own communicator (a
    # small allreduce loop; a fused round loop; a ring of point-to-point messages, small
    # and large), so one drives while the others wait, the driver starts the others'
    # queued tasks, and work passes back and forth between drivers and the thread.
    comms = [t.world().dup() for _ in range(3)]
    errors: list[BaseException] = []

    def guarded(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # reported below
                errors.append(e)
        return run

    def small_allreduces() -> None:
        for it in range(200):
            got = comms[0].allreduce(np.array([it * (R + 1)], np.int64))
            expect_equal(got, np.array([it * RANK_SUM], np.int64), f"threaded allreduce {it}")

    def fused_rounds() -> None:
        with t.FusedAllreduce([t.TensorSpec("a", 256, "float32"), t.TensorSpec("b", 40000, "float32")],
                              1024, comm=comms[1]) as f:
            for it in range(60):
                f.submit(1, np.full(40000, R + it, np.float32))
                f.submit(0, np.full(256, R - it, np.float32))
                a, b = f.wait()
                expect_equal(a, np.full(256, N * (N - 1) // 2 - N * it, np.float32), f"fused a {it}")
                expect_equal(b, np.full(40000, N * (N - 1) // 2 + N * it, np.float32), f"fused b {it}")

    def ring_messages() -> None:
        c = comms[2]
        for it in range(60):
            n = 3 if it % 3 else 70000  # small ones are driven; large ones are the thread's
            req = c.isend(np.full(n, R * 1000 + it, np.int32), (R + 1) % N, [it])
            got = c.recv((R - 1) % N, [it], np.int32, [n])
            expect_equal(got, np.full(n, ((R - 1) % N) * 1000 + it, np.int32), f"ring message {it}")
            req.wait()

    threads = [threading.Thread(target=guarded(fn)) for fn in (small_allreduces, fused_rounds, ring_messages)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


@check
def fused_slots_aligned_to_64_bytes() -> None:
    specs = [t.TensorSpec("a", 5, "float32"), t.TensorSpec("b", 17, "float32"),
             t.TensorSpec("c", 3, "float64"), t.TensorSpec("d", 9, "float64")]
    with t.FusedAllreduce(specs, 1 << 20, slot_alignment=64) as f:
        # float32 slots at multiples of 16 elements, float64 at multiples of 8
        assert f.slot_offsets == [0, 16, 0, 8], f.slot_offsets
        for it in range(3):
            for i, sp in enumerate(specs):
                f.submit(i, np.full(sp.count, it + R + i, sp.dtype))
            buckets = f.wait_buckets()
            for i, sp in enumerate(specs):
                b = next(k for k, members in enumerate(f.plan) if i in members)
                got = buckets[b][f.slot_offsets[i]:f.slot_offsets[i] + sp.count]
                expect_equal(got, np.full(sp.count, N * (it + i) + N * (N - 1) // 2, sp.dtype), f"slot {i}")
            expect_equal(buckets[0][5:16], np.zeros(11, np.float32), "padding")
            for i, sp in enumerate(specs):
                f.submit(i, np.full(sp.count, R, sp.dtype))
            per_tensor = f.wait()
            expect_equal(per_tensor[1], np.full(17, N * (N - 1) // 2, np.float32), "wait() with padding")
    expect_raises(ValueError, "power of two", t.FusedAllreduce, specs, 0, t.Op.SUM, None, 48)


@check
def bad_input_errors() -> None:
    expect_raises(ValueError, "np.ascontiguousarray", t.allreduce, np.zeros((4, 4))[:, 1])
    expect_raises(TypeError, "supported: float16", t.allreduce, np.zeros(3, np.uint8))
    expect_raises(TypeError, "np.asarray", t.allreduce, [1.0, 2.0])
    expect_raises(ValueError, "Op.AVG is not defined for integer", t.allreduce,
                  np.zeros(3, np.int32), t.Op.AVG)
    expect_raises(TypeError, "broadcast_object", t.broadcast, np.array([object()]))
    expect_raises(ValueError, "native byte order", t.allreduce, np.zeros(3, ">f4"))
    expect_raises(ValueError, "at least one dimension", t.allgather, np.array(1.0))
    expect_raises(ValueError, "count must be", t.TensorSpec, "x", -1, "float32")
    expect_raises(TypeError, "cannot be reduced", t.TensorSpec, "x", 3, "uint8")
    expect_raises(ValueError, "integer tensor 'i'", t.FusedAllreduce,
                  [t.TensorSpec("i", 3, "int32")], 0, t.Op.AVG)


import checks_c_api  # noqa: E402,F401  (the C interface native code calls)
import checks_comm  # noqa: E402,F401  (registers the communicator/point-to-point checks)

run_all(R)
t.barrier()
