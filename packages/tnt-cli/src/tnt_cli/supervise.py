"""Run the starter, forward Ctrl+C/SIGTERM to it, and leave no process behind.

The starter runs in its own session, so the launcher can find every process it
(indirectly) started on this host by session id and kill what is left, even when
the starter itself had to be killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: After forwarding a stop signal, how long the starter may take to stop its ranks
#: before the launcher kills the whole session (the issue allows 10 s in total).
STOP_GRACE_S = 6.0
#: Leftovers of a finished starter get SIGTERM, then SIGKILL after this.
LEFTOVER_GRACE_S = 2.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def session_members(sid: int, proc_dir: Path = Path("/proc")) -> list[int]:
    """Pids whose session id is `sid` (Linux /proc); empty elsewhere."""
    members: list[int] = []
    try:
        entries = list(proc_dir.iterdir())
    except OSError:  # pragma: no cover - no /proc
        return members
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command name (which may hold spaces) start after ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(entry.name))
    return members


def kill_session(sid: int, grace_s: float = LEFTOVER_GRACE_S) -> list[int]:
    """SIGTERM every process of the session, SIGKILL survivors after `grace_s`."""
    first = session_members(sid)
    for pid in first:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and session_members(sid):
        time.sleep(0.05)
    for pid in session_members(sid):
        _signal(pid, signal.SIGKILL)
    return first


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Stopper:
    """Forwards the first stop signal as SIGTERM; a second one kills the session."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.signum: int | None = None
        self.deadline: float | None = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in _STOP_SIGNALS}

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is None:
            self.signum = signum
            self.deadline = time.monotonic() + STOP_GRACE_S
            _signal(self.proc.pid, signal.SIGTERM)
        else:
            self.deadline = time.monotonic()  # asked twice: stop now

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class Outcome:
    """Exit code for the launcher: the starter's, or 128+signal when interrupted."""

    code: int
    interrupted_by: int | None = None


def run(argv: Sequence[str], env: Mapping[str, str]) -> Outcome:
    """Start the starter with `env` added to our environment and wait for it."""
    full_env = {**os.environ, **env}
    proc = subprocess.Popen(list(argv), env=full_env, start_new_session=True)
    stopper = _Stopper(proc)
    try:
        while True:
            try:
                returncode = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                if stopper.deadline is not None and time.monotonic() >= stopper.deadline:
                    kill_session(proc.pid, grace_s=0.0)
    finally:
        stopper.restore()
        kill_session(proc.pid)  # whatever the starter left behind on this host
    if stopper.signum is not None:
        return Outcome(128 + stopper.signum, stopper.signum)
    return Outcome(128 - returncode if returncode < 0 else returncode)
