"""Multi-process tests: real mpirun launches on 1-4 ranks (few launches, many checks each)."""

from __future__ import annotations

import re
import time

import pytest
from conftest import explain

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_collectives_and_fused_engine(run_job, ranks: int) -> None:
    proc = run_job("job_collectives.py", ranks)
    assert proc.returncode == 0, explain(proc)
    ok = re.findall(r"rank (\d+): CHECKS OK (\d+)", proc.stdout)
    assert sorted(int(r) for r, _ in ok) == list(range(ranks)), explain(proc)
    assert all(int(n) >= 24 for _, n in ok), explain(proc)


@pytest.mark.parametrize(
    "spins",
    [
        # sleep-only paths of the communication thread and of waiting callers, which
        # never drive (every request is the thread's); buckets kept and reused across
        # rounds (TNT_COMM_TRANSIENT_BUCKETS=0, the former default)
        {"TNT_COMM_POLL_SPIN_US": "0", "TNT_COMM_WAIT_SPIN_US": "0", "TNT_COMM_HANDOFF_SPIN_US": "0",
         "TNT_COMM_DRIVE_SPIN_US": "0", "TNT_COMM_TRANSIENT_BUCKETS": "0"},
        # every spin on (hand-off spins are off by default on a 2-core host), and buckets
        # let go of after each round (Note [Transient buckets], the default: every value still right)
        {"TNT_COMM_WAIT_SPIN_US": "1000", "TNT_COMM_HANDOFF_SPIN_US": "50"},
    ],
    ids=["spins_off_kept_buckets", "spins_on_transient_buckets"],
)
def test_collectives_with_polling_spins_off_and_on(run_job, spins: dict[str, str]) -> None:
    # Note [Polling], [Hand-off], [Waiter drives]: every result right whichever way the
    # threads wait.
    proc = run_job("job_collectives.py", 2, env=spins)
    assert proc.returncode == 0, explain(proc)
    ok = re.findall(r"rank (\d+): CHECKS OK (\d+)", proc.stdout)
    assert sorted(int(r) for r, _ in ok) == [0, 1], explain(proc)


def test_stall_of_a_skipped_allreduce_raises_quickly(run_job) -> None:
    t0 = time.perf_counter()
    proc = run_job("job_stall.py", 2, env={"MODE": "plain", "TNT_COMM_TIMEOUT": "1.5"}, timeout=60)
    elapsed = time.perf_counter() - t0
    out = proc.stdout
    assert "rank 0: STALL after" in out, explain(proc)
    line = next(x for x in out.splitlines() if x.startswith("rank 0: STALL"))
    assert "allreduce(float32 (10,), SUM)" in line
    assert "Missing ranks (never arrived): 1" in line
    assert "TNT_COMM_TIMEOUT" in line
    assert "NO ERROR" not in out
    assert "rank 0: THEN tnt_comm is unusable after an earlier error" in out, explain(proc)
    assert elapsed < 30, f"took {elapsed:.1f}s"


def test_stall_in_fused_engine_names_bucket_and_tensor(run_job) -> None:
    proc = run_job("job_stall.py", 2, env={"MODE": "fused", "TNT_COMM_TIMEOUT": "1.5"}, timeout=60)
    out = proc.stdout
    line0 = next((x for x in out.splitlines() if x.startswith("rank 0: STALL")), "")
    assert "FusedAllreduce bucket 1 of 2" in line0 and "'late'" in line0, explain(proc)
    assert "Missing ranks (never arrived): 1" in line0, explain(proc)
    line1 = next((x for x in out.splitlines() if x.startswith("rank 1: STALL")), "")
    assert "never submitted on this rank ('late')" in line1, explain(proc)
    assert "TNT_COMM_TIMEOUT" in line1


def test_recv_from_a_rank_that_never_sends_raises_stall(run_job) -> None:
    proc = run_job("job_stall.py", 2, env={"MODE": "recv", "TNT_COMM_TIMEOUT": "1.5"}, timeout=60)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("rank 0: STALL")), "")
    assert "recv(from rank 1, header (3, 0, 0), float32 (4,)) on world" in line, explain(proc)
    assert "did not complete within 1.5 s" in line and "TNT_COMM_TIMEOUT" in line, explain(proc)
    assert "rank 0: THEN tnt_comm is unusable after an earlier error" in proc.stdout, explain(proc)


def test_long_local_work_on_one_rank_is_not_a_stall(run_job) -> None:
    proc = run_job("job_stall.py", 2, env={"MODE": "busy", "TNT_COMM_TIMEOUT": "1.5"}, timeout=60)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count("BUSY OK") == 2, explain(proc)


def test_rank_that_never_starts_fails_start_up(run_job) -> None:
    t0 = time.perf_counter()
    proc = run_job("job_stall.py", 2, env={"MODE": "init", "TNT_COMM_TIMEOUT": "2"}, timeout=60)
    elapsed = time.perf_counter() - t0
    assert proc.returncode != 0, explain(proc)
    line = next((x for x in proc.stdout.splitlines() if "INIT STALL" in x), "")
    assert "start-up (MPI_Init and the world communicator) did not complete within 2 s" in line, explain(proc)
    assert "TNT_COMM_TIMEOUT" in line and "NO ERROR" not in proc.stdout, explain(proc)
    assert elapsed < 30, f"took {elapsed:.1f}s"


def test_broadcast_and_allgather_above_2_gib(run_job) -> None:
    proc = run_job("job_large.py", 2, timeout=180)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count("BROADCAST OK") == 2 and proc.stdout.count("ALLGATHER OK") == 2, explain(proc)


def test_uncaught_exception_aborts_the_job(run_job) -> None:
    t0 = time.perf_counter()
    proc = run_job("job_uncaught.py", 2, env={"TNT_COMM_TIMEOUT": "100"}, timeout=60)
    elapsed = time.perf_counter() - t0
    assert proc.returncode != 0, explain(proc)
    assert "boom from the last rank" in proc.stderr, explain(proc)
    assert "aborting all ranks" in proc.stderr, explain(proc)
    assert "UNREACHABLE" not in proc.stdout
    assert elapsed < 40, f"took {elapsed:.1f}s: the abort did not end the waiting rank"


@pytest.mark.parametrize("code", [1, 0], ids=["sys_exit_1", "returns_early"])
def test_rank_that_exits_early_ends_the_job(run_job, code: int) -> None:
    # TNT_COMM_TIMEOUT=100: ending within seconds proves the leave notice, not the stall
    # detector, ended the job.
    t0 = time.perf_counter()
    proc = run_job("job_exit.py", 2, env={"CODE": str(code), "TNT_COMM_TIMEOUT": "100"}, timeout=60)
    elapsed = time.perf_counter() - t0
    assert proc.returncode != 0, explain(proc)
    assert "barrier() can never complete on rank 0" in proc.stderr, explain(proc)
    assert "rank 1 has ended" in proc.stderr and "after its collective #1" in proc.stderr, explain(proc)
    assert "UNREACHABLE" not in proc.stdout
    assert elapsed < 40, f"took {elapsed:.1f}s: the leave notice did not end the waiting rank"


def test_mismatched_collectives_are_named_as_such(run_job) -> None:
    t0 = time.perf_counter()
    proc = run_job("job_mismatch.py", 2, env={"TNT_COMM_TIMEOUT": "100"}, timeout=60)
    elapsed = time.perf_counter() - t0
    assert proc.returncode != 0, explain(proc)
    assert "ran different collectives" in proc.stderr, explain(proc)
    assert "UnicodeDecodeError" not in proc.stderr, explain(proc)
    assert "UNREACHABLE" not in proc.stdout
    assert elapsed < 40, f"took {elapsed:.1f}s"
