"""The launcher's own process handling: exit codes, signals, leftovers (no MPI needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import is_running, wait_for

from tnt_cli import supervise
from tnt_cli.errors import EnvironmentProblem
from tnt_cli.supervise import descendants, kill_tree, run


def test_exit_code_and_environment_reach_the_starter(tmp_path: Path) -> None:
    out = tmp_path / "out"
    outcome = run(["sh", "-c", f'printf %s "$FOO" > {out}; exit 3'], {"FOO": "b=c d"})
    assert (outcome.code, outcome.interrupted_by) == (3, None)
    assert out.read_text() == "b=c d"


def test_starter_killed_by_signal_gives_128_plus_signal() -> None:
    assert run(["sh", "-c", "kill -KILL $$"], {}).code == 128 + signal.SIGKILL


def test_orphaned_leftovers_of_a_finished_starter_are_killed(tmp_path: Path) -> None:
    """The starter exits and leaves a background process: it is found (re-parented to
    the launcher, the subreaper) and killed; a process started before is spared."""
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        pidfile = tmp_path / "pid"
        outcome = run(["sh", "-c", f"sleep 300 & echo $! > {pidfile}; exit 0"], {})
        assert outcome.code == 0
        assert not is_running(int(pidfile.read_text()))
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_daemonised_leftover_is_killed(tmp_path: Path) -> None:
    """Even a double-forked process in a new session stays in the launcher's tree."""
    pidfile = tmp_path / "pid"
    script = f"(setsid sleep 300 & echo $! > {pidfile}) ; exit 0"
    assert run(["sh", "-c", script], {}).code == 0
    assert not is_running(int(pidfile.read_text()))


def _interrupt_when(ready: Path, sig: int) -> threading.Thread:
    """Send `sig` to this process once `ready` holds the starter's pid.

    Watchdog: if the run has not ended 20 s later, SIGKILL the starter and its tree
    so a broken stop path fails the test instead of hanging it.
    """

    def go() -> None:
        wait_for(lambda: ready.exists() and ready.read_text().strip() != "", 30, f"{ready}")
        starter = int(ready.read_text().split()[0])
        os.kill(os.getpid(), sig)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and is_running(starter):
            time.sleep(0.1)
        for pid in [starter, *descendants(starter)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def test_stop_signal_escalates_to_kill_when_ignored(tmp_path: Path, monkeypatch) -> None:
    """A starter and child that ignore SIGTERM are killed once the grace period ends."""
    monkeypatch.setattr(supervise, "STOP_GRACE_S", 0.5)
    ready = tmp_path / "ready"
    # Ignored signals stay ignored across fork and exec, so the child sleep ignores them too.
    script = (f"trap '' TERM INT HUP; sleep 300 & echo $$ $! > {ready}.tmp; "
              f"mv {ready}.tmp {ready}; wait")
    thread = _interrupt_when(ready, signal.SIGINT)
    started = time.monotonic()
    outcome = run(["sh", "-c", script], {})
    elapsed = time.monotonic() - started
    thread.join(timeout=30)
    assert (outcome.code, outcome.interrupted_by) == (130, signal.SIGINT)
    assert elapsed < 15, "the watchdog, not the launcher, ended the run"
    assert not is_running(int(ready.read_text().split()[1]))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_other_stop_signals(tmp_path: Path, sig: int) -> None:
    ready = tmp_path / "ready"
    thread = _interrupt_when(ready, sig)
    started = time.monotonic()
    outcome = run(["sh", "-c", f"echo $$ > {ready}.tmp; mv {ready}.tmp {ready}; sleep 300"], {})
    elapsed = time.monotonic() - started
    thread.join(timeout=30)
    assert outcome == supervise.Outcome(128 + sig, sig)
    assert elapsed < 15, "the watchdog, not the launcher, ended the run"


def test_starter_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EnvironmentProblem, match=r"cannot start /nonexistent/mpirun: No such file"):
        run(["/nonexistent/mpirun"], {})


def test_handlers_are_restored_after_run() -> None:
    before = signal.getsignal(signal.SIGINT)
    run(["true"], {})
    assert signal.getsignal(signal.SIGINT) is before


def test_descendants_and_kill_tree() -> None:
    proc = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"])
    try:
        wait_for(lambda: len(descendants(proc.pid)) == 2, 10, "the two sleeps")
        assert proc.pid in descendants(os.getpid())
        killed = kill_tree(proc.pid, grace_s=1.0)
        assert len(killed) == 2
        proc.wait(timeout=5)
        assert descendants(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_descendants_of_a_process_without_children() -> None:
    proc = subprocess.Popen(["sleep", "300"])
    try:
        assert descendants(proc.pid) == []
    finally:
        proc.kill()
        proc.wait()
