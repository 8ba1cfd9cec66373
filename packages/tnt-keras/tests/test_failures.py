"""Failure handling on 2 ranks, through the launcher: every way one rank can fail mid-fit
must end the whole job promptly, non-zero, with the cause shown and no process left.

Each scenario is one launch of jobs/failures.py. The time measured is from the moment
the failing rank failed (it writes the time just before) to the launcher's exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import JOBS, _launcher

#: Start-up (TensorFlow import on 2 ranks of a shared 2-core machine) until the failure.
START_DEADLINE_S = 300
#: The stall limit for the scenarios that need the stall detector.
STALL_TIMEOUT_S = 10
#: TNT_COMM_TIMEOUT elsewhere: high, so ending fast proves it was not the stall detector.
HIGH_TIMEOUT_S = "300"


def _env(timeout: str) -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "TNT_COMM_TIMEOUT": timeout}


def _leftovers(marker: str) -> list[str]:
    """Command lines of live processes that belong to the job (they name its folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(cmdline)
    return found


class Run:
    def __init__(self, scenario: str, folder: Path, timeout: str = HIGH_TIMEOUT_S) -> None:
        self.folder = folder
        cmd = [_launcher(), "-n", "2", "--python-interpreter", sys.executable, "--",
               str(JOBS / "failures.py"), "--out", str(folder / "out"), "--scenario", scenario]
        with (folder / "stdout").open("w") as out, (folder / "stderr").open("w") as err:
            self.proc = subprocess.Popen(cmd, env=_env(timeout), stdout=out, stderr=err)
        self.started = time.time()

    def wait_for(self, name: str) -> float:
        """Wait until the job wrote `name` (or ended); return the time in it."""
        path = self.folder / name
        while not path.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended before writing {name}:\n{self.output()}")
            if time.time() - self.started > START_DEADLINE_S:
                self.kill()
                pytest.fail(f"no {name} after {START_DEADLINE_S} s:\n{self.output()}")
            time.sleep(0.05)  # polling for the job's own signal, not a synchronisation
        return float(path.read_text())

    def finish(self, limit_s: float) -> tuple[int, float]:
        """Exit code and the seconds from the failure to the launcher's exit."""
        failed_at = self.wait_for("failed_at")
        try:
            code = self.proc.wait(timeout=limit_s + 60)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job was still running {limit_s + 60} s after the failure:\n{self.output()}")
        return code, time.time() - failed_at

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)

    def output(self) -> str:
        out = (self.folder / "stdout").read_text(errors="replace")
        err = (self.folder / "stderr").read_text(errors="replace")
        return f"exit {self.proc.poll()}\n--- stdout\n{out[-5000:]}\n--- stderr\n{err[-8000:]}"

    @property
    def stderr(self) -> str:
        return (self.folder / "stderr").read_text(errors="replace")


def _report(scenario: str, code: int, seconds: float) -> None:
    print(f"\nFAILURE SCENARIO {scenario}: job ended {seconds:.1f} s after the failure, exit code {code}")


def _assert_ended(run: Run, scenario: str, limit_s: float) -> int:
    code, seconds = run.finish(limit_s)
    _report(scenario, code, seconds)
    assert code != 0, run.output()
    assert not (run.folder / "out").exists(), "the job finished training despite the failure"
    assert seconds < limit_s, f"took {seconds:.1f} s (limit {limit_s} s)\n{run.output()}"
    assert _leftovers(str(run.folder)) == [], _leftovers(str(run.folder))
    return code


def test_uncaught_exception_on_rank1(tmp_path):
    run = Run("raise", tmp_path)
    _assert_ended(run, "raise", limit_s=20)
    err = run.stderr
    # The failing rank's traceback, shown once (by the launcher, from rank 1's stderr).
    assert err.count("RuntimeError: injected failure on rank 1 at epoch 1, batch 5") == 1, run.output()
    assert "aborting all ranks" in err, run.output()


def test_sigkill_of_rank1(tmp_path):
    run = Run("sigkill", tmp_path)
    _assert_ended(run, "sigkill", limit_s=30)
    assert "rank 1" in run.stderr and "SIGKILL" in run.stderr, run.output()


def test_sys_exit_on_rank1(tmp_path):
    run = Run("sys_exit", tmp_path)
    _assert_ended(run, "sys_exit", limit_s=20)
    assert "rank 1 has ended" in run.stderr, run.output()


def test_os_exit_on_rank1(tmp_path):
    run = Run("os_exit", tmp_path)
    _assert_ended(run, "os_exit", limit_s=20)
    assert "rank 1 failed with exit code 4" in run.stderr, run.output()


def test_rank1_returns_early(tmp_path):
    """Rank 1 stops training (stop_training on one rank only) and its script ends."""
    run = Run("return_early", tmp_path)
    _assert_ended(run, "return_early", limit_s=20)
    assert "rank 1 has ended" in run.stderr and "can never complete on rank 0" in run.stderr, run.output()


def test_rank1_blocks_inside_a_step(tmp_path):
    run = Run("sleep_in_step", tmp_path, timeout=str(STALL_TIMEOUT_S))
    _assert_ended(run, "sleep_in_step", limit_s=STALL_TIMEOUT_S + 20)
    err = run.stderr
    assert f"did not complete within {STALL_TIMEOUT_S} s on rank 0" in err, run.output()
    assert "FusedAllreduce bucket" in err and "'grad:sequential/dense/kernel'" in err, run.output()
    assert "Missing ranks (never arrived): 1" in err and "TNT_COMM_TIMEOUT" in err, run.output()


def test_rank0_runs_a_collective_rank1_skips(tmp_path):
    run = Run("skip_collective", tmp_path, timeout=str(STALL_TIMEOUT_S))
    _assert_ended(run, "skip_collective", limit_s=STALL_TIMEOUT_S + 20)
    err = run.stderr
    # Collectives that meet on one communicator are compared ("ran different
    # collectives"); the gradient engine has a communicator of its own, so there the
    # rank that skipped is named as missing, with the likely cause.
    assert "ran different collectives" in err or (
        "Missing ranks (never arrived)" in err and "skipped this" in err
    ), run.output()


def test_caught_error_on_one_rank_then_a_collective(tmp_path):
    """A rank that catches its own error and runs on out of step gets a clean error on every
    rank (different collectives / stall naming the missing rank), never a crash inside MPI."""
    run = Run("catch_continue", tmp_path, timeout=str(STALL_TIMEOUT_S))
    _assert_ended(run, "catch_continue", limit_s=STALL_TIMEOUT_S + 20)
    err = run.stderr
    assert "ran different collectives" in err or "Missing ranks (never arrived)" in err, run.output()
    assert "Segmentation fault" not in err and "MPI_ERR_TRUNCATE" not in err, run.output()


def test_ctrl_c_stops_all_ranks(tmp_path):
    run = Run("sigint", tmp_path)
    run.wait_for("training")
    sent = time.time()
    run.proc.send_signal(signal.SIGINT)
    code = run.proc.wait(timeout=60)
    seconds = time.time() - sent
    _report("ctrl_c", code, seconds)
    assert code == 130, run.output()
    assert seconds < 10, f"took {seconds:.1f} s"
    assert _leftovers(str(tmp_path)) == []
