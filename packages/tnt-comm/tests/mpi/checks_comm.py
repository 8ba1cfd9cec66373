"""Communicators and point-to-point checks, run inside job_collectives.py (one launch
per rank count). Expected values are computed here with numpy from known inputs."""

from __future__ import annotations

import numpy as np
from _harness import check

import tnt_comm as t

W = t.world()
R, N = W.rank, W.size


def expect_raises(exc: type[BaseException], fragments: list[str], fn, *args, **kw) -> str:
    try:
        fn(*args, **kw)
    except exc as e:
        for f in fragments:
            assert f in str(e), f"message {str(e)!r} lacks {f!r}"
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__} ({fragments})")


def layout() -> tuple[int, int]:
    """(stages p, replicas) for the pipeline layout rank = replica * p + stage."""
    p = 2 if N % 2 == 0 else N
    return p, N // p


@check
def world_matches_module_functions() -> None:
    assert (W.rank, W.size) == (t.rank(), t.size())
    assert t.world() is W
    assert "rank" in repr(W)


@check
def split_into_pipeline_and_replica_groups() -> None:
    p, replicas = layout()
    stage, replica = R % p, R // p
    pipe = W.split(color=replica, key=stage)
    reps = W.split(color=stage, key=replica)
    assert (pipe.rank, pipe.size) == (stage, p), (pipe.rank, pipe.size)
    assert (reps.rank, reps.size) == (replica, replicas), (reps.rank, reps.size)
    # Which world ranks share each group, seen through the groups' own collectives.
    members = pipe.allgather(np.array([R], np.int64))
    assert members.tolist() == [replica * p + s for s in range(p)], members
    members = reps.allgather(np.array([R], np.int64))
    assert members.tolist() == [r * p + stage for r in range(replicas)], members
    # key reverses the order; equal keys keep the parent's order.
    rev = W.split(color=0, key=-R)
    assert rev.rank == N - 1 - R
    same = W.split(color=R % 2, key=0)
    assert same.rank == R // 2
    # Derived from a derived communicator.
    halves = pipe.split(color=pipe.rank % 2, key=pipe.rank)
    assert halves.allgather(np.array([R], np.int64)).tolist() == [
        replica * p + s for s in range(p) if s % 2 == stage % 2
    ]
    expect_raises(ValueError, ["color=-1", ">= 0"], W.split, -1, 0)
    expect_raises(TypeError, ["color must be an int"], W.split, 1.5, 0)


@check
def collectives_on_a_sub_communicator() -> None:
    p, _ = layout()
    stage, replica = R % p, R // p
    pipe = W.split(color=replica, key=stage)
    got = pipe.allreduce(np.full(3, R, np.float64))
    assert got.tolist() == [float(sum(replica * p + s for s in range(p)))] * 3, got
    assert pipe.allreduce(np.array([R], np.int64), t.Op.MAX).tolist() == [replica * p + p - 1]
    assert pipe.allreduce(np.array([R + 1.0]), t.Op.AVG)[0] == np.mean([replica * p + s + 1 for s in range(p)])
    last = p - 1
    got = pipe.broadcast(np.full((2, 2), R, np.int32), root=last)
    assert (got == replica * p + last).all(), got
    assert pipe.broadcast_object({"r": R}, root=0) == {"r": replica * p}
    assert pipe.allgather_object(R) == [replica * p + s for s in range(p)]
    pipe.barrier()
    expect_raises(ValueError, ["root=" + str(p), "not a rank"], pipe.broadcast, np.zeros(1), p)
    # The world still works between sub-communicator calls.
    assert W.allreduce(np.ones(1))[0] == N


@check
def fused_engine_on_a_replica_group() -> None:
    p, replicas = layout()
    stage, replica = R % p, R // p
    reps = W.split(color=stage, key=replica)
    specs = [t.TensorSpec(f"s{stage}w{i}", 50 + 10 * i, "float32") for i in range(5)]
    with t.FusedAllreduce(specs, 256, comm=reps) as f:
        for it in range(3):
            for i in reversed(range(len(specs))) if replica % 2 else range(len(specs)):
                f.submit(i, np.full(specs[i].count, R + it, np.float32))
            out = f.wait()
            want = sum(r * p + stage for r in range(replicas)) + replicas * it
            for s, y in zip(specs, out):
                assert (y == want).all(), (s.name, y[:3], want)
    expect_raises(TypeError, ["comm must be a tnt_comm.Communicator"], t.FusedAllreduce, specs, 0, t.Op.SUM, "world")


@check
def two_engines_used_in_opposite_orders() -> None:
    # Without one communicator per engine, rank 0's bucket of A would meet rank 1's
    # bucket of B in MPI and both sums would be silently wrong.
    specs_a = [t.TensorSpec("a", 100, "float32")]
    specs_b = [t.TensorSpec("b", 100, "float32")]
    with t.FusedAllreduce(specs_a, 0) as a, t.FusedAllreduce(specs_b, 0) as b:
        for it in range(5):
            first, second = (a, b) if (R + it) % 2 == 0 else (b, a)
            first.submit(0, np.full(100, (1 if first is a else 100) * (R + 1), np.float32))
            second.submit(0, np.full(100, (1 if second is a else 100) * (R + 1), np.float32))
            got = {id(e): e.wait()[0] for e in (first, second)}
            ya, yb = got[id(a)], got[id(b)]
            total = N * (N + 1) // 2
            assert (ya == total).all() and (yb == 100 * total).all(), (it, ya[0], yb[0], total)


@check
def send_recv_ring_all_forms() -> None:
    if N == 1:
        # A message to oneself works with the non-blocking forms.
        req = W.irecv(0, (7,), np.float32, (3,))
        W.isend(np.arange(3, dtype=np.float32), 0, (7,)).wait()
        assert req.wait().tolist() == [0.0, 1.0, 2.0]
        return
    right, left = (R + 1) % N, (R - 1) % N
    for it in range(3):
        x = np.arange(12, dtype=np.float64).reshape(3, 4) + 100 * R + it
        req = W.irecv(left, (it, 0), np.float64, (3, 4))
        W.send(x, right, (it, 0))
        got = req.wait()
        assert got.shape == (3, 4) and got.dtype == np.float64
        assert (got == np.arange(12).reshape(3, 4) + 100 * left + it).all(), got
    # isend + recv, every dtype kind, empty and 0-d arrays, large message; the sent
    # array is copied at once (changing it after isend does not change the message).
    for dtype in (np.float16, np.int64, np.uint8, np.bool_, np.complex64):
        x = (np.arange(10) + R).astype(dtype)
        s = W.isend(x, right, (1, 2, 3))
        x[:] = 0
        got = W.recv(left, (1, 2, 3), dtype, (10,))
        s.wait()
        assert s.test()
        assert (got == (np.arange(10) + left).astype(dtype)).all(), (dtype, got)
    s = W.isend(np.zeros((0, 5), np.float32), right, ())
    assert W.recv(left, (), np.float32, (0, 5)).shape == (0, 5)
    s.wait()
    s = W.isend(np.array(R, np.int32), right, (9,))
    assert int(W.recv(left, (9,), np.int32, ())) == left
    big = np.full(3_000_000, R, np.float32)
    s = W.isend(big, right, (5,))
    assert (W.recv(left, (5,), np.float32, (3_000_000,)) == left).all()
    s.wait()
    # Many small messages in flight keep their order.
    reqs = [W.irecv(left, (k,), np.int64, (1,)) for k in range(50)]
    sends = [W.isend(np.array([k * 10 + R]), right, (k,)) for k in range(50)]
    for k, r in enumerate(reqs):
        assert r.wait()[0] == k * 10 + left
    for s in sends:
        s.wait()
    expect_raises(ValueError, ["dest=" + str(N), "not a rank"], W.isend, np.ones(1), N, (0,))
    expect_raises(TypeError, ["header must be a tuple of ints"], W.isend, np.ones(1), right, (1.5,))
    expect_raises(ValueError, ["at most 8"], W.isend, np.ones(1), right, tuple(range(9)))


@check
def subclass_overrides_of_the_round_calls_are_kept() -> None:
    """The engine binds the core's round calls on the instance, but not over a subclass's."""
    calls = []

    class Timed(t.FusedAllreduce):
        def submit(self, index, array):
            calls.append("submit")
            super().submit(index, array)

        def wait_buckets(self):
            calls.append("wait_buckets")
            return super().wait_buckets()

    with Timed([t.TensorSpec("g", 4, "float32")], 1 << 20) as f:
        f.submit(0, np.ones(4, np.float32))
        out = f.wait_buckets()
        assert calls == ["submit", "wait_buckets"], calls
        assert (out[0] == N).all(), out
        f.submit(0, np.full(4, 2.0, np.float32))
        assert (f.wait()[0] == 2 * N).all()


@check
def borrowed_sends_hold_their_array_until_complete() -> None:
    """isend(copy=False): no copy, the request holds the array until the message is done."""
    import gc
    import sys

    if N == 1:
        return
    right, left = (R + 1) % N, (R - 1) % N
    n = 1 << 20  # 4 MiB: above every eager limit, the message waits for its receiver
    for finish in ("wait", "test", "drop"):
        req = W.irecv(left, (41,), np.float32, (n,))
        x = np.full(n, R + 0.5, np.float32)
        base = sys.getrefcount(x)
        s = W.isend(x, right, (41,), copy=False)
        assert sys.getrefcount(x) == base + 1, "a borrowed send must hold its array"
        if finish == "wait":
            s.wait()
            assert sys.getrefcount(x) == base, "wait() must let go of the array"
        elif finish == "test":
            while not s.test():
                pass
            assert sys.getrefcount(x) == base, "a test() that finds it complete must let go"
        else:  # dropped first: the request waits for completion, then lets go
            del x, s
            gc.collect()
        got = req.wait()
        assert (got == left + 0.5).all(), (finish, got[:4])
        t.barrier()
    y = np.ones(8, np.float32)
    base = sys.getrefcount(y)
    s = W.isend(y, right, (42,))  # copy=True (default): nothing held
    assert sys.getrefcount(y) == base
    W.recv(left, (42,), np.float32, (8,))
    s.wait()


@check
def pipeline_1f1b_steady_state() -> None:
    """Each stage alternately sends activations forward and receives gradients back
    (the one-forward-one-backward schedule), with non-blocking sends: no deadlock, and
    every message is the one expected."""
    p, _ = layout()
    if p == 1:
        return
    stage, replica = R % p, R // p
    pipe = W.split(color=replica, key=stage)
    m, width = 6, 64
    acts: dict[int, np.ndarray] = {}
    pending: list[t.Request] = []
    step = 1

    def forward(i: int) -> None:
        x = np.full(width, float(i), np.float32) if stage == 0 else pipe.recv(stage - 1, (step, i, 0), np.float32, (width,))
        assert (x == i + stage).all(), (stage, i, x[:2])
        acts[i] = x
        if stage < p - 1:
            pending.append(pipe.isend(x + 1, stage + 1, (step, i, 0)))

    def backward(i: int) -> None:
        g = np.full(width, -float(i), np.float32) if stage == p - 1 else pipe.recv(stage + 1, (step, i, 1), np.float32, (width,))
        assert (g == -i - (p - 1 - stage)).all(), (stage, i, g[:2])
        acts.pop(i)
        if stage > 0:
            pending.append(pipe.isend(g - 1, stage - 1, (step, i, 1)))

    warmup = min(p - stage - 1, m)
    most = 0
    for i in range(warmup):
        forward(i)
        most = max(most, len(acts))
    for k in range(m - warmup):
        forward(warmup + k)
        most = max(most, len(acts))
        backward(k)
    for k in range(m - warmup, m):
        backward(k)
    for r in pending:
        r.wait()
    assert not acts and most <= min(p - stage, m), (most, acts.keys())
    W.barrier()


@check
def header_dtype_and_shape_mismatch_is_a_clear_error() -> None:
    if N == 1:
        return
    right, left = (R + 1) % N, (R - 1) % N
    W.isend(np.ones(4, np.float32), right, (3, 1, 0))
    msg = expect_raises(t.CommError, [f"from rank {left}", "expected header (3, 2, 0)", "has header (3, 1, 0)",
                                      "header differ"], W.recv, left, (3, 2, 0), np.float32, (4,))
    assert "float32 (4,)" in msg
    W.isend(np.ones(4, np.float32), right, (4,))
    expect_raises(t.CommError, ["expected header (4,) with float64 (4,)", "with float32 (4,)", "dtype/shape differ"],
                  W.recv, left, (4,), np.float64, (4,))
    W.isend(np.ones(4, np.float32), right, (5,))  # longer than expected
    expect_raises(t.CommError, ["float32 (3,)", "has header (5,) with float32 (4,)"], W.recv, left, (5,), np.float32, (3,))
    W.isend(np.ones(4, np.float32), right, (6,))  # shorter than expected
    expect_raises(t.CommError, ["float32 (2, 4)", "with float32 (4,)"], W.recv, left, (6,), np.float32, (2, 4))
    # Each bad message was consumed whole: the stream stays in step and usable.
    W.isend(np.full(2, R, np.int32), right, (7,))
    assert W.recv(left, (7,), np.int32, (2,)).tolist() == [left, left]
    assert W.allreduce(np.ones(1))[0] == N
