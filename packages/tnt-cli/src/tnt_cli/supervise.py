"""Run the starter, forward Ctrl+C/SIGTERM to it, and leave no process behind.

The starter stays in the launcher's process group, so in a terminal it is in the
foreground: it can forward stdin to rank 0, and Ctrl+C reaches it as usual. To find
every process it (indirectly) started on this host, the launcher makes itself a
*child subreaper* (Linux): a process whose parent dies is re-parented to the launcher
instead of init, so all of them stay in the launcher's process tree, where they are
found and killed when the starter ends or has to be stopped.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tnt_cli.errors import EnvironmentProblem
from tnt_cli.output import StarterOutput

#: After forwarding a stop signal, how long the starter may take to stop its ranks
#: before the launcher kills the whole tree (the issue allows 10 s in total).
STOP_GRACE_S = 6.0
#: Leftovers of a finished starter get SIGTERM, then SIGKILL after this.
LEFTOVER_GRACE_S = 2.0
#: Once the starter's output shows the job failing, it normally ends within a second; it
#: hangs when it waits for a host it cannot reach. After this long it gets SIGTERM, and
#: SIGKILL FAILURE_KILL_S later.
FAILURE_GRACE_S = 3.0
FAILURE_KILL_S = 2.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return False


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to us, not init (Linux >= 3.4)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _parents(proc_dir: Path = Path("/proc")) -> dict[int, int]:
    """pid -> parent pid of every live (non-zombie) process, from /proc."""
    parents: dict[int, int] = {}
    try:
        entries = list(proc_dir.iterdir())
    except OSError:  # pragma: no cover - no /proc
        return parents
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command name (which may hold spaces) start after ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(root: int, proc_dir: Path = Path("/proc")) -> list[int]:
    """Live descendants of `root` (children first), excluding `root` itself."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents(proc_dir).items():
        children.setdefault(parent, []).append(pid)
    found: list[int] = []
    frontier = [root]
    while frontier:
        nxt = [child for pid in frontier for child in children.get(pid, [])]
        found.extend(nxt)
        frontier = nxt
    return found


def kill_tree(
    root: int, grace_s: float = LEFTOVER_GRACE_S, spare: frozenset[int] = frozenset()
) -> list[int]:
    """SIGTERM every descendant of `root` not in `spare`, SIGKILL survivors after
    `grace_s`, and reap those that became our children."""

    def targets() -> list[int]:
        return [pid for pid in descendants(root) if pid not in spare]

    first = targets()
    for pid in first:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and targets():
        _reap(first)
        time.sleep(0.05)
    for pid in targets():
        _signal(pid, signal.SIGKILL)
    _reap(first, wait_s=1.0)
    return first


def _reap(pids: Sequence[int], wait_s: float = 0.0) -> None:
    """Collect exit statuses of those pids that became our children (no zombies left)."""
    deadline = time.monotonic() + wait_s
    pending = list(pids)
    while pending:
        still = []
        for pid in pending:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # not our child (or already collected)
            if done == 0:
                still.append(pid)
        pending = still
        if not pending or time.monotonic() >= deadline:
            return
        time.sleep(0.02)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _starter_dies_with_us() -> None:
    """In the starter before exec: SIGTERM if the launcher dies (even by SIGKILL).

    SIGPIPE is ignored: the launcher reads the starter's output through pipes, and once
    the launcher is dead a starter writing its shutdown messages would die of SIGPIPE
    before stopping its ranks (they would be left running).
    """
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)


class _Stopper:
    """Forwards the first stop signal as SIGTERM; a second one kills the tree."""

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
    stopped_after_failure: bool = False
    failure_grace_s: float = FAILURE_GRACE_S


def run(
    argv: Sequence[str], env: Mapping[str, str], output: StarterOutput | None = None
) -> Outcome:
    """Start the starter with `env` added to our environment and wait for it.

    With `output`, the starter's stderr goes through that filter, and a starter that
    has not ended FAILURE_GRACE_S after its output showed a failure is stopped.
    """
    become_subreaper()
    me = os.getpid()
    already_running = frozenset(descendants(me))  # not ours to clean up (library use)
    full_env = {**os.environ, **env}
    try:
        pipe = subprocess.PIPE if output is not None else None
        proc = subprocess.Popen(list(argv), env=full_env, preexec_fn=_starter_dies_with_us,
                                stdout=pipe, stderr=pipe)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot start {argv[0]}: {exc.strerror or exc}") from exc
    readers = []
    if output is not None:
        assert proc.stdout is not None and proc.stderr is not None
        for stdout, pipe_file in ((True, proc.stdout), (False, proc.stderr)):
            readers.append(threading.Thread(target=output.consume_fd,
                                            args=(pipe_file.fileno(), stdout), daemon=True))
            readers[-1].start()
    stopper = _Stopper(proc)
    stopped_after_failure = False
    try:
        while True:
            try:
                returncode = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if (output is not None and output.failure_at is not None
                        and not stopped_after_failure and stopper.deadline is None
                        and now >= output.failure_at + FAILURE_GRACE_S):
                    stopped_after_failure = True
                    stopper.deadline = now + FAILURE_KILL_S
                    _signal(proc.pid, signal.SIGTERM)
                if stopper.deadline is not None and now >= stopper.deadline:
                    for pid in [proc.pid, *descendants(proc.pid)]:
                        _signal(pid, signal.SIGKILL)
    finally:
        stopper.restore()
        if proc.poll() is None:  # only on an exception in the loop above
            proc.kill()
            proc.wait()
        kill_tree(me, spare=already_running)  # whatever the starter left behind here
        for reader in readers:
            reader.join(timeout=LEFTOVER_GRACE_S)  # a leftover may hold a pipe open
    if stopper.signum is not None:
        return Outcome(128 + stopper.signum, stopper.signum)
    return Outcome(128 - returncode if returncode < 0 else returncode,
                   stopped_after_failure=stopped_after_failure)
