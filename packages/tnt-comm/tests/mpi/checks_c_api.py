"""The C interface (tnt_comm_c_api.h) called through ctypes, as native code calls it:
results equal numpy's, and bad handles or mismatched arguments are errors with messages."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
from _harness import check

import tnt_comm as t

R, N = t.rank(), t.size()
W = t.world()
I64P = ctypes.POINTER(ctypes.c_int64)
ERR = 1024


class CApi(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int32),
        ("struct_size", ctypes.c_int32),
        ("allreduce", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, I64P,
                                       ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32, ctypes.c_char_p,
                                       ctypes.c_size_t)),
        ("allgather", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, I64P,
                                       ctypes.c_int32, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t)),
        ("fused_submit", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64, I64P,
                                          ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t)),
        ("fused_wait_buckets", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                                ctypes.POINTER(ctypes.c_void_p), I64P, ctypes.c_char_p,
                                                ctypes.c_size_t)),
        ("fused_wait_buckets_borrow", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                                       ctypes.POINTER(ctypes.c_void_p), I64P,
                                                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                                                       ctypes.c_size_t)),
        ("fused_release", ctypes.CFUNCTYPE(None, ctypes.c_void_p)),
        ("fused_wait_bucket_borrow", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                                      ctypes.POINTER(ctypes.c_void_p), I64P,
                                                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                                                      ctypes.c_size_t)),
    ]


API = CApi.from_address(t.c_api_address())


def shape_of(a: np.ndarray) -> ctypes.Array:
    return (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


@check
def c_api_table_and_header() -> None:
    assert API.version == t.C_API_VERSION == 3, API.version
    assert API.struct_size == ctypes.sizeof(CApi), (API.struct_size, ctypes.sizeof(CApi))
    header = Path(t.c_api_include_dir()) / "tnt_comm_c_api.h"
    assert f"#define TNT_COMM_C_API_VERSION {t.C_API_VERSION}" in header.read_text()


@check
def c_api_allreduce_and_allgather_match_numpy() -> None:
    handle = W.native_handle()
    assert handle == W.native_handle()  # one id per communicator
    x = (np.arange(12, dtype=np.float32).reshape(3, 4) + 1) * (R + 1)
    out = np.empty_like(x)
    err = ctypes.create_string_buffer(ERR)
    assert API.allreduce(handle, ptr(x), ptr(out), shape_of(x), 2, b"float32", int(t.Op.SUM), err, ERR) == 0, err.value
    assert np.array_equal(out, (np.arange(12, dtype=np.float32).reshape(3, 4) + 1) * N * (N + 1) / 2)
    m = np.array([R, -R], dtype=np.int64)
    assert API.allreduce(handle, ptr(m), ptr(m), shape_of(m), 1, b"int64", int(t.Op.MAX), err, ERR) == 0  # in place
    assert m.tolist() == [N - 1, 0]
    g = np.empty((N, 2, 4), np.float32)
    row = np.full((1, 2, 4), R, np.float32)
    assert API.allgather(handle, ptr(row), ptr(g), shape_of(row), 3, b"float32", err, ERR) == 0, err.value
    assert np.array_equal(g, np.arange(N, dtype=np.float32)[:, None, None] * np.ones((N, 2, 4), np.float32))


@check
def c_api_errors_are_codes_with_messages() -> None:
    err = ctypes.create_string_buffer(ERR)
    x = np.zeros(2, np.float32)
    assert API.allreduce(987654, ptr(x), ptr(x), shape_of(x), 1, b"float32", 0, err, ERR) == 3  # TNT_ERR_ARG
    assert b"no live communicator with native handle 987654" in err.value, err.value
    assert API.allreduce(W.native_handle(), ptr(x), ptr(x), shape_of(x), 1, b"complex64", 0, err, ERR) == 3
    assert b"complex64" in err.value, err.value
    if N > 1:  # shapes that differ across ranks: the check names every rank's arguments
        y = np.zeros(R + 1, np.float32)
        assert API.allreduce(W.native_handle(), ptr(y), ptr(y), shape_of(y), 1, b"float32", 0, err, ERR) != 0
        assert b"float32 (1,)" in err.value and b"float32 (2,)" in err.value, err.value
        rows = np.zeros((R + 1, 2), np.float32)  # the native allgather needs one shape everywhere
        out = np.zeros((N, R + 1, 2), np.float32)
        assert API.allgather(W.native_handle(), ptr(rows), ptr(out), shape_of(rows), 2, b"float32", err, ERR) == 3
        assert b"differ in length along axis 0" in err.value, err.value


@check
def c_api_fused_engine_round() -> None:
    specs = [t.TensorSpec(f"c{i}", 3 + i, "float32") for i in range(4)]
    with t.FusedAllreduce(specs, 16, comm=W, slot_alignment=64) as f:
        handle = f.native_handle()
        err = ctypes.create_string_buffer(ERR)
        values = [np.full(s.count, R + 1 + i, np.float32) for i, s in enumerate(specs)]
        for members in f.plan:
            idx = (ctypes.c_int64 * len(members))(*members)
            # the last tensor is submitted as NULL: zeros, as a rank without data sends
            data = (ctypes.c_void_p * len(members))(*(None if i == 3 else values[i].ctypes.data for i in members))
            assert API.fused_submit(handle, len(members), idx, data, err, ERR) == 0, err.value
        sizes = [f.slot_offsets[m[-1]] + specs[m[-1]].count - f.slot_offsets[m[0]] for m in f.plan]
        outs = [np.empty(n, np.float32) for n in sizes]
        out_p = (ctypes.c_void_p * len(outs))(*(o.ctypes.data for o in outs))
        caps = (ctypes.c_int64 * len(outs))(*(o.nbytes for o in outs))
        assert API.fused_wait_buckets(handle, len(outs), out_p, caps, err, ERR) == 0, err.value
        for members, flat in zip(f.plan, outs):
            for i in members:
                got = flat[f.slot_offsets[i] - f.slot_offsets[members[0]]:][:specs[i].count]
                want = 0 if i == 3 else sum(r + 1 + i for r in range(N))
                assert (got == want).all(), (i, got, want)
        bad = (ctypes.c_int64 * len(outs))(*(o.nbytes + 4 for o in outs))
        for members in f.plan:  # a second round whose outputs are the wrong size
            idx = (ctypes.c_int64 * len(members))(*members)
            data = (ctypes.c_void_p * len(members))(*(values[i].ctypes.data for i in members))
            assert API.fused_submit(handle, len(members), idx, data, err, ERR) == 0, err.value
        assert API.fused_wait_buckets(handle, len(outs), out_p, bad, err, ERR) == 3
        assert b"bytes, its output" in err.value, err.value
    one = (ctypes.c_int64 * 1)(0)
    data = (ctypes.c_void_p * 1)(values[0].ctypes.data)
    assert API.fused_submit(handle, 1, one, data, err, ERR) == 1, err.value  # TNT_ERR_COMM
    assert b"the engine was closed" in err.value, err.value


@check
def c_api_borrowed_buckets_never_change_while_held() -> None:
    """fused_wait_buckets_borrow hands out the bucket itself (no copy): a held bucket keeps
    its round's values while later rounds reduce elsewhere; a released one is reused."""
    specs = [t.TensorSpec(f"b{i}", 5 + i, "float32") for i in range(3)]
    with t.FusedAllreduce(specs, 16, comm=W, slot_alignment=64) as f:
        handle = f.native_handle()
        err = ctypes.create_string_buffer(ERR)
        nb = len(f.plan)

        def round_(scale: float) -> tuple[list[int], list[int], list[np.ndarray]]:
            values = [np.full(s.count, (R + 1 + i) * scale, np.float32) for i, s in enumerate(specs)]
            for members in f.plan:
                idx = (ctypes.c_int64 * len(members))(*members)
                data = (ctypes.c_void_p * len(members))(*(values[i].ctypes.data for i in members))
                assert API.fused_submit(handle, len(members), idx, data, err, ERR) == 0, err.value
            out = (ctypes.c_void_p * nb)()
            nbytes = (ctypes.c_int64 * nb)()
            hold = (ctypes.c_void_p * nb)()
            assert API.fused_wait_buckets_borrow(handle, nb, out, nbytes, hold, err, ERR) == 0, err.value
            views = [np.ctypeslib.as_array(ctypes.cast(out[b], ctypes.POINTER(ctypes.c_float)),
                                           (nbytes[b] // 4,)) for b in range(nb)]
            return [out[b] for b in range(nb)], [hold[b] for b in range(nb)], views

        def slot(views: list[np.ndarray], i: int) -> np.ndarray:
            b = next(k for k, m in enumerate(f.plan) if i in m)
            start = f.slot_offsets[i] - f.slot_offsets[f.plan[b][0]]
            return views[b][start:start + specs[i].count]

        want = lambda i, scale: sum((r + 1 + i) * scale for r in range(N))  # noqa: E731
        addr1, hold1, views1 = round_(1.0)
        assert all(a % 64 == 0 for a in addr1), addr1
        addr2, hold2, views2 = round_(10.0)  # round 1 still held: reduced in fresh buffers
        assert not set(addr1) & set(addr2), (addr1, addr2)
        for i in range(len(specs)):
            assert (slot(views1, i) == want(i, 1.0)).all(), (i, slot(views1, i))
            assert (slot(views2, i) == want(i, 10.0)).all(), (i, slot(views2, i))
        for h in hold1 + hold2:
            API.fused_release(h)
        # Nothing held: the buckets are reused, not reallocated. Reuse is decided on the
        # buffer's reference count at submit time; a bucket task lets go of its copy before it
        # reports the round done (fused.cc), so only a holder dropping its copy concurrently
        # could make a count stale, which merely allocates a fresh buffer (buffer.cc): reuse
        # must show within a few rounds (before that fix, under load, it never did on 3 ranks).
        previous, reused = addr2, 0
        for k in range(12):
            addr3, hold3, views3 = round_(100.0 + k)
            for i in range(len(specs)):
                assert (slot(views3, i) == want(i, 100.0 + k)).all(), (k, i, slot(views3, i))
            for h in hold3:
                API.fused_release(h)
            reused += addr3 == previous
            previous = addr3
        if os.environ.get("TNT_COMM_TRANSIENT_BUCKETS", "1") == "0":  # else freed: the check below
            assert reused >= 1, f"no round of 12 reused its released buckets ({reused})"
        bad = (ctypes.c_void_p * nb)()
        assert API.fused_wait_buckets_borrow(handle, nb + 1, bad, (ctypes.c_int64 * (nb + 1))(), bad,
                                             err, ERR) == 3
        assert b"outputs for" in err.value, err.value


@check
def c_api_buckets_one_at_a_time() -> None:
    """fused_wait_bucket_borrow (Note [One bucket at a time]): a bucket is handed out as soon
    as it is reduced, before later buckets were even submitted; each once per round, and the
    round re-arms after the last one."""
    specs = [t.TensorSpec(f"o{i}", 5 + i, "float32") for i in range(3)]
    with t.FusedAllreduce(specs, 16, comm=W, slot_alignment=64) as f:
        handle = f.native_handle()
        err = ctypes.create_string_buffer(ERR)
        nb = len(f.plan)
        assert nb == 3, f.plan
        for scale in (1.0, 10.0):  # two rounds: the first re-armed the engine
            values = [np.full(s.count, (R + 1 + i) * scale, np.float32) for i, s in enumerate(specs)]
            for b, members in enumerate(f.plan):
                idx = (ctypes.c_int64 * len(members))(*members)
                data = (ctypes.c_void_p * len(members))(*(values[i].ctypes.data for i in members))
                assert API.fused_submit(handle, len(members), idx, data, err, ERR) == 0, err.value
                out, nbytes, hold = ctypes.c_void_p(), ctypes.c_int64(), ctypes.c_void_p()
                assert API.fused_wait_bucket_borrow(handle, b, ctypes.byref(out), ctypes.byref(nbytes),
                                                    ctypes.byref(hold), err, ERR) == 0, err.value
                (i,) = members
                view = np.ctypeslib.as_array(ctypes.cast(out, ctypes.POINTER(ctypes.c_float)), (nbytes.value // 4,))
                assert (view[:specs[i].count] == sum((r + 1 + i) * scale for r in range(N))).all(), (b, view)
                if b == 0 and scale == 1.0:  # taken already this round
                    again = ctypes.c_void_p()
                    assert API.fused_wait_bucket_borrow(handle, 0, ctypes.byref(again), ctypes.byref(nbytes),
                                                        ctypes.byref(again), err, ERR) == 3
                    assert b"already handed out" in err.value, err.value
                del view
                API.fused_release(hold)
        assert API.fused_wait_bucket_borrow(handle, nb, ctypes.byref(out), ctypes.byref(nbytes),
                                            ctypes.byref(hold), err, ERR) == 3
        assert b"out of range" in err.value, err.value


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@check
def c_api_transient_buckets_are_freed_with_their_last_holder() -> None:
    """Note [Transient buckets]: by default (TNT_COMM_TRANSIENT_BUCKETS=1) the engine lets go
    of a round's buckets when it hands them out, so a borrowed 64 MiB bucket leaves the
    process when its holder releases it; with TNT_COMM_TRANSIENT_BUCKETS=0 the engine keeps
    it for the next round."""
    transient = os.environ.get("TNT_COMM_TRANSIENT_BUCKETS", "1") not in ("", "0")
    count = 16 << 20  # float32: 64 MiB, above glibc's mmap threshold (returned to the system when freed)
    specs = [t.TensorSpec("big", count, "float32")]
    with t.FusedAllreduce(specs, 1 << 30, comm=W) as f:
        handle = f.native_handle()
        err = ctypes.create_string_buffer(ERR)
        values = np.full(count, R + 1.0, np.float32)
        idx = (ctypes.c_int64 * 1)(0)
        data = (ctypes.c_void_p * 1)(values.ctypes.data)
        assert API.fused_submit(handle, 1, idx, data, err, ERR) == 0, err.value
        out, nbytes, hold = (ctypes.c_void_p * 1)(), (ctypes.c_int64 * 1)(), (ctypes.c_void_p * 1)()
        assert API.fused_wait_buckets_borrow(handle, 1, out, nbytes, hold, err, ERR) == 0, err.value
        view = np.ctypeslib.as_array(ctypes.cast(out[0], ctypes.POINTER(ctypes.c_float)), (count,))
        assert view[0] == view[-1] == N * (N + 1) / 2, (view[0], view[-1])
        del view
        held = _resident_bytes()
        API.fused_release(hold[0])
        dropped = held - _resident_bytes()
        if transient:
            assert dropped >= 56 << 20, f"transient: releasing the only holder freed {dropped >> 20} MiB, not ~64"
        else:
            assert dropped < 8 << 20, f"kept buckets: releasing the holder freed {dropped >> 20} MiB; the engine keeps it"

