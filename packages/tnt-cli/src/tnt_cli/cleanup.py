"""`--cleanup`: stop leftover processes of a program on this host.

Only processes a launch started are candidates: every rank (and whatever it starts)
carries `TARANTELLA_JOB_ID` in its environment, so `tail -f train.py` or an editor on the
script is never touched.

Run on every host of a hostfile through the MPI starter (one process per host):

    python -m tnt_cli.cleanup [--force] [--dry-run] PROGRAM
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

GRACE_S = 5.0
_MARK = b"TARANTELLA_JOB_ID="


def _started_by_launcher(environ: bytes) -> bool:
    return any(item.startswith(_MARK) for item in environ.split(b"\0"))


def _ancestors(pid: int, proc_dir: Path) -> set[int]:
    seen: set[int] = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            stat = (proc_dir / str(pid) / "stat").read_text()
            pid = int(stat.rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return seen


def _matches(args: list[str], program: str, real: str | None, cwd: str) -> bool:
    """An argument equal to `program`, or naming the same file (relative to the process's cwd)."""
    for arg in args:
        if arg == program:
            return True
        if real is not None and os.path.basename(arg) == os.path.basename(real):
            if os.path.realpath(os.path.join(cwd, arg)) == real:
                return True
    return False


def find_program_processes(program: str, proc_dir: Path = Path("/proc")) -> list[tuple[int, str]]:
    """Processes of the current user, started by a launch (marked with TARANTELLA_JOB_ID), whose
    command line names `program` (never us or our ancestors)."""
    real = os.path.realpath(program) if os.path.exists(program) else None
    skip = _ancestors(os.getpid(), proc_dir)
    uid = os.getuid()
    found: list[tuple[int, str]] = []
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            raw = (entry / "cmdline").read_bytes()
            cwd = os.readlink(entry / "cwd")
            if not _started_by_launcher((entry / "environ").read_bytes()):
                continue
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        if args and _matches(args, program, real, cwd):
            found.append((int(entry.name), " ".join(args)))
    return sorted(found)


def stop(pids: Sequence[int], force: bool, grace_s: float | None = None) -> list[int]:
    """SIGTERM (SIGKILL with force) the pids; return those still alive after `grace_s`."""
    grace_s = GRACE_S if grace_s is None else grace_s
    sig = signal.SIGKILL if force else signal.SIGTERM
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _alive(pid)]
        if alive:
            time.sleep(0.05)
    return alive


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def cleanup(program: str, force: bool = False, dry_run: bool = False) -> int:
    """Stop the program's processes here; exit code 1 when some survived."""
    host = socket.gethostname()
    found = find_program_processes(program)
    verb = "would stop" if dry_run else "stopping"
    for pid, cmdline in found:
        print(f"{host}: {verb} {pid}: {cmdline}", flush=True)
    if not found:
        print(f"{host}: no processes of {program} started by tarantella found", flush=True)
        return 0
    if dry_run:
        return 0
    alive = stop([pid for pid, _ in found], force)
    if alive:
        print(f"{host}: still running after {GRACE_S:.0f} s: {alive}; "
              "use --cleanup --force to kill them", flush=True)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tnt_cli.cleanup")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("program")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return cleanup(args.program, args.force, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
