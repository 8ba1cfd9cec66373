"""Per-rank wrapper, run by the MPI starter on every rank before the user's program.

    python -m tnt_cli.rank [--output master|all] [--numa cpu|cpu+mem] -- PROGRAM ARGS...

Why a wrapper and not MPI-specific output flags: it behaves the same under Open MPI,
MPICH, Intel MPI and srun, and it can keep the error of a failing rank that is not
the master. Master-only mode: rank 0 *becomes* the program (exec, no extra process);
other ranks run it with stdout discarded and stderr kept in a bounded buffer, which
is printed (prefixed with the rank) only when that rank fails. All-ranks mode: every
line of every rank is prefixed with `[rank]`.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

from tnt_cli.errors import LaunchError
from tnt_cli.numa import find_numactl, numa_nodes, numactl_prefix

#: Checked in order: the MPI's own variable first (an outer Slurm step's SLURM_PROCID
#: is inherited by ranks of an mpirun started inside sbatch).
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")

#: Lines of a hidden rank's stderr kept for the failure report.
TAIL_LINES = 200
_MAX_LINE = 4096
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1
#: Start-up noise of TensorFlow (absl/glog info and warning lines, absl's pre-init
#: notice, cuInit failing on a machine without GPU) that TF_CPP_MIN_LOG_LEVEL does not
#: silence; left out of a failing rank's
#: report and of non-master ranks' output unless --verbose.
_STARTUP_NOISE = re.compile(
    rb"[IW]\d{4} [\d:.]+\s+\d+ \S+:\d+\] "
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called"
    rb"|E\d{4} [\d:.]+\s+\d+ \S+:\d+\] failed call to cuInit"  # no GPU here: expected
)
_TRACEBACK = b"Traceback (most recent call last):"


def _first_int(environ: Mapping[str, str], names: Sequence[str]) -> int:
    for name in names:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def rank_from_env(environ: Mapping[str, str]) -> int:
    """This process's rank as the starter announced it; 0 outside any launcher."""
    return _first_int(environ, RANK_VARS)


def local_rank_from_env(environ: Mapping[str, str]) -> int:
    return _first_int(environ, LOCAL_RANK_VARS)


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL if this wrapper dies (e.g. is SIGKILLed)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


class _Forwarder:
    """Passes signals the wrapper receives on to the program; remembers the first."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.received: int | None = None
        for sig in _FORWARDED:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signum
        try:
            self.proc.send_signal(signum)
        except ProcessLookupError:
            pass


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"failed with exit code {returncode}"


def is_startup_noise(line: bytes) -> bool:
    return _STARTUP_NOISE.match(line) is not None


def worth_showing(tail: list[bytes]) -> list[bytes]:
    """A failing rank's stderr tail without what hides its error: from its first
    traceback on, if it has one, else without start-up noise."""
    for i, line in enumerate(tail):
        if line.startswith(_TRACEBACK):
            return tail[i:]
    return [line for line in tail if not is_startup_noise(line)]


def failed_on_its_own(tail: list[bytes]) -> bool:
    """Whether a rank that was also signalled had failed first: a program that prints its
    traceback and then ends the job (MPI_Abort) is signalled by the starter while it
    aborts, and its error is the one the user must see. A KeyboardInterrupt traceback is
    the forwarded Ctrl-C, shown by the master already."""
    shown = worth_showing(tail)
    if not shown or not shown[0].startswith(_TRACEBACK):
        return False
    return not any(line.startswith(b"KeyboardInterrupt") for line in shown)


def _copy_prefixed(src: IO[bytes], dst: IO[bytes], prefix: bytes, quiet: bool = False) -> None:
    for line in src:
        if quiet and is_startup_noise(line):
            continue
        if not line.endswith(b"\n"):
            line += b"\n"
        dst.write(prefix + line)
        dst.flush()


def _keep_tail(src: IO[bytes], tail: collections.deque[bytes]) -> None:
    for line in src:
        tail.append(line[:_MAX_LINE])


def _finish(threads: list[threading.Thread], pipes: list[IO[bytes]]) -> None:
    """Let readers drain the pipes, then close them.

    A grandchild that keeps the pipe open must not keep the rank alive: after 2 s the
    readers are abandoned (daemon threads) and the pipes left to process exit.
    """
    for thread in threads:
        thread.join(timeout=2.0)
    if not any(thread.is_alive() for thread in threads):
        for pipe in pipes:
            pipe.close()


def _start(command: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(list(command), preexec_fn=_die_with_parent, **kwargs)  # type: ignore[call-overload]


def run_hidden(command: Sequence[str], rank: int, err: IO[bytes], verbose: bool = False) -> int:
    """Run a non-master rank silently; print its stderr tail only if it fails."""
    proc = _start(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                  stderr=subprocess.PIPE)
    forwarder = _Forwarder(proc)
    tail: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)
    assert proc.stderr is not None
    reader = threading.Thread(target=_keep_tail, args=(proc.stderr, tail), daemon=True)
    reader.start()
    returncode = proc.wait()
    _finish([reader], [proc.stderr])
    if returncode != 0 and (forwarder.received is None or failed_on_its_own(list(tail))):
        prefix = f"[{rank}] ".encode()
        err.write(prefix + f"tarantella: rank {rank} {_describe(returncode)}; "
                  "the end of its stderr:\n".encode())
        for line in list(tail) if verbose else worth_showing(list(tail)):
            err.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
        err.flush()
    return _exit_code(returncode)


def run_prefixed(
    command: Sequence[str], rank: int, out: IO[bytes], err: IO[bytes], verbose: bool = False
) -> int:
    """Run a rank with every output line prefixed by `[rank] ` (non-master ranks'
    start-up noise left out unless verbose)."""
    proc = _start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _Forwarder(proc)
    prefix = f"[{rank}] ".encode()
    assert proc.stdout is not None and proc.stderr is not None
    copiers = [
        threading.Thread(target=_copy_prefixed, args=(proc.stdout, out, prefix), daemon=True),
        threading.Thread(target=_copy_prefixed,
                         args=(proc.stderr, err, prefix, rank != 0 and not verbose), daemon=True),
    ]
    for copier in copiers:
        copier.start()
    returncode = proc.wait()
    _finish(copiers, [proc.stdout, proc.stderr])
    return _exit_code(returncode)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tnt_cli.rank")
    parser.add_argument("--output", choices=("master", "all"), default="master")
    parser.add_argument("--numa", choices=("cpu", "cpu+mem"), default=None)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(list(argv))
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no program given")
    return args


def _stop_with_starter() -> None:
    """SIGTERM to this rank if the process that started it (the MPI starter or its daemon)
    dies: a starter killed abruptly, or one that dies of a broken pipe after the launcher
    was killed, cannot stop its ranks itself. Kept across the master's exec."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() == 1:  # the starter died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    _stop_with_starter()
    args = _parse(sys.argv[1:] if argv is None else argv)
    rank = rank_from_env(os.environ)
    command: list[str] = args.command
    try:
        if args.numa:
            prefix = numactl_prefix(local_rank_from_env(os.environ), args.numa,
                                    find_numactl(), numa_nodes())
            command = [*prefix, *command]
        if args.output == "all":
            return run_prefixed(command, rank, sys.stdout.buffer, sys.stderr.buffer,
                                args.verbose)
        if rank == 0:
            sys.stdout.flush()
            os.execvp(command[0], command)  # the master simply becomes the program
        return run_hidden(command, rank, sys.stderr.buffer, args.verbose)
    except LaunchError as exc:
        print(f"[{rank}] tarantella: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"[{rank}] tarantella: cannot start {command[0]!r}: {exc.strerror or exc}",
              file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
