"""Fixtures of the multi-host tests: one 3-host test bed per session, jobs launched on it.

The bed is removed at the end of the session, also after a failure or Ctrl+C/SIGTERM
(fixture finalizer); beds left by a crashed earlier run are removed at the start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import testbed

JOBS = Path(__file__).parent / "jobs"
TARANTELLA = str(Path(sys.executable).parent / "tarantella")
#: Measured scenario outcomes, printed at the end of the session (never asserted there).
REPORT: list[str] = []
#: Launches of the current test (stopped at its end if a failure or Ctrl+C left them).
STARTED: list[subprocess.Popen[bytes]] = []


def _availability() -> str | None:
    try:
        testbed.check_available()
    except testbed.TestBedUnavailable as exc:
        return str(exc)
    return None


UNAVAILABLE = _availability()
#: Under CI (CI=true) as root an unavailable bed fails the tests (testbed.must_fail).
MUST_FAIL = testbed.must_fail(os.environ.get("CI"), os.geteuid())


def pytest_report_header() -> str:
    if UNAVAILABLE:
        doing = "FAILING (CI=true, root)" if MUST_FAIL else "SKIPPING"
        return f"multihost: {doing} every test: network namespaces unavailable: {UNAVAILABLE}"
    return "multihost: network namespaces available (a 3-host test bed is built)"


def pytest_terminal_summary(terminalreporter) -> None:
    if UNAVAILABLE:
        terminalreporter.write_line(f"multihost tests {'failed' if MUST_FAIL else 'skipped'}: {UNAVAILABLE}")
    if REPORT:
        terminalreporter.section("multi-host scenarios (measured)")
        for line in REPORT:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def bed() -> Iterator[testbed.TestBed]:
    if UNAVAILABLE and MUST_FAIL:
        pytest.fail(f"CI=true and running as root, but network namespaces cannot be made: {UNAVAILABLE}",
                    pytrace=False)
    if UNAVAILABLE:
        pytest.skip(f"network namespaces unavailable: {UNAVAILABLE}")
    removed = testbed.remove_stale()
    if removed:
        print(f"removed stale test bed namespaces: {removed}")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # so the finalizer runs
    made = testbed.TestBed(3)
    try:
        yield made.up()
    finally:
        made.down()
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(autouse=True)
def nothing_left_running(request) -> Iterator[None]:
    """After every test: no process on any host (a leftover fails the test).

    A launch still running here belongs to a test that failed or was interrupted: it
    is killed (with everything on the hosts) without a second error.
    """
    STARTED.clear()
    yield
    if "bed" not in request.fixturenames:
        return
    made: testbed.TestBed = request.getfixturevalue("bed")
    abandoned = [proc for proc in STARTED if proc.poll() is None]
    for proc in abandoned:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + (0 if abandoned else 10)
    while any(made.processes().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {h: [_cmdline(p) for p in pids] for h, pids in made.processes().items() if pids}
    for host in left:
        made.kill_host(host)
    assert abandoned or not left, f"processes left running on the hosts: {left}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


@dataclass
class Job:
    """One launch of `tarantella` on host1 of the bed; output goes to files."""

    proc: subprocess.Popen[bytes]
    folder: Path
    started: float

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the job was still running after {timeout} s\n{self.output()}")

    def wait_for(self, name: str, timeout: float = 120) -> float:
        """Until the job wrote folder/name (its own signal), return the time in it."""
        path = self.folder / name
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the job did not write {name}\n{self.output()}")
            time.sleep(0.05)
        return float(path.read_text() or time.time())

    @property
    def stdout(self) -> str:
        return (self.folder / "stdout").read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return (self.folder / "stderr").read_text(errors="replace")

    def output(self) -> str:
        return (f"exit {self.proc.poll()}\n--- stdout\n{self.stdout[-4000:]}\n"
                f"--- stderr\n{self.stderr[-8000:]}")


def job_env(made: testbed.TestBed, **extra: str) -> dict[str, str]:
    return {**os.environ, **made.mca_env(), "PYTHONUNBUFFERED": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2", **extra}


def start_job(made: testbed.TestBed, folder: Path, args: list[str], **env: str) -> Job:
    """`tarantella ARGS` started on host1 (as a user logged in there would)."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = made.on("host1", [TARANTELLA, *args])
    with (folder / "stdout").open("wb") as out, (folder / "stderr").open("wb") as err:
        proc = subprocess.Popen(argv, env=job_env(made, **env), stdout=out, stderr=err)
    STARTED.append(proc)
    return Job(proc, folder, time.time())


def record(scenario: str, seconds: float | None, code: int | None, extra: str = "") -> None:
    """A measured outcome for the end-of-session table (and the test's own output)."""
    ended = "" if seconds is None else f": ended {seconds:.1f} s after the event, exit code {code}"
    line = f"{scenario}{ended}{extra}"
    REPORT.append(line)
    print(line)
