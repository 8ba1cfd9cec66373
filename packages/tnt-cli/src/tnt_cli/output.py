"""What the user sees of the MPI starter's output: clean text, each error once.

The starter's stdout and stderr carry three kinds of lines: the ranks' own (rank 0 unprefixed,
failing ranks as `[r] ...` from the rank wrapper), the MPI's own banners (Open MPI's
help messages framed by dashed rules, `[host:pid] ***` lines, "N more processes have
sent help message"), and stray NUL bytes Open MPI writes after a help message. This
filter, fed line by line, removes the NULs, holds the MPI banners back (shown with
`--verbose`, or at the end when they are the only explanation of a failure), shows a
traceback that several ranks print identically once, and notices the lines that mean
the job is failing — also when the starter ends with exit code 0 (Open MPI does after
losing a host) or never ends (it waits for a host it cannot reach).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO

#: Open MPI frames its help messages with 74 dashes, PRRTE with 60.
_RULE = re.compile(rb"-{50,80}\s*\Z")
#: ...and a framed block is taken for the MPI's only when it speaks of MPI things: a
#: program's own table between dashed lines is shown.
_MPI_WORDS = re.compile(rb"MPI|PRTE|prte|PMIx|daemon|mpirun|mpiexec|orted|ORTE|process rank")
_MPI_LINE = re.compile(
    rb"\[[^\]\s]+:\d+\] \*\*\* "  # [host:pid] *** An error occurred in ...
    rb"|\[[^\]\s]+:\d+\] [a-z]+:[a-z_]+: "  # [host:pid] plm:ssh: Warning: ...
    rb"|\d+ more process(?:es)? ha(?:s|ve) sent help message"
    rb"|Set MCA parameter \S+ to 0 to see all help"
)
_PREFIX = re.compile(rb"\[\d+\] ")
_TRACEBACK = b"Traceback (most recent call last):"
#: Lines by which a failing rank explains itself (its error is then on screen).
_RANK_ERROR = re.compile(rb"tarantella: rank \d+ |Traceback \(most recent call last\)|tnt_comm: ")
#: Lines that mean the job is failing, and how to name the cause in one line: only the
#: MPI's, tnt_comm's and the rank wrapper's own words (a program's "lost connection,
#: retrying" must not stop its job).
_FAILURES: tuple[tuple[re.Pattern[bytes], str], ...] = (
    (re.compile(rb"tarantella: (rank \d+ (?:failed with exit code \d+|was killed by signal \w+))"), ""),
    (re.compile(rb"uncaught (\w+ on rank \d+); aborting all ranks"), ""),
    (re.compile(rb"(MPI_ABORT was invoked on rank \d+)"), ""),
    (re.compile(rb"exited due to (process rank \d+)"), "{} ended the job"),
    (re.compile(rb"(detected that one or more processes exited with non-zero status)"), "a rank failed"),
    (re.compile(rb"A daemon failed to report back"),
     "the MPI daemon of another host ended or could not be reached"),
    (re.compile(rb"(?:PRTE|ORTE|prterun|mpirun) has lost communication"), "a host was lost"),
    (re.compile(rb"MPI communication peer process has unexpectedly disconnected"),
     "a rank lost the connection to a peer"),
    (re.compile(rb"\[[^\]\s]+:\d+\] \*\*\* An error occurred in (.*)"), "an MPI error ({})"),
)
_MAX_BANNER_LINES = 60
_MAX_TRACEBACK_LINES = 400


def _failure_in(line: bytes) -> str | None:
    for pattern, text in _FAILURES:
        match = pattern.search(line)
        if match:
            found = match.group(1).decode(errors="replace").strip() if match.groups() else ""
            return (text.format(found) if text else found)[:160]
    return None


@dataclass
class _Stream:
    """One output stream of the starter and what is held back from it."""

    sink: IO[bytes]
    banner: list[bytes] | None = None
    tracebacks: dict[bytes, list[bytes]] = field(default_factory=dict)  # rank prefix -> lines

    @property
    def holding(self) -> bool:
        return self.banner is not None or bool(self.tracebacks)


class StarterOutput:
    """Filters the starter's stderr into `sink` (and its stdout into `out_sink`, when
    given); remembers the first sign of failure on either."""

    def __init__(self, sink: IO[bytes], verbose: bool = False,
                 out_sink: IO[bytes] | None = None) -> None:
        self.sink = sink
        self.verbose = verbose
        self.failure: str | None = None
        self.failure_at: float | None = None  # time.monotonic() of the first sign
        self.rank_error_shown = False
        self.hidden: list[list[bytes]] = []
        self._err = _Stream(sink)
        self._out = _Stream(out_sink) if out_sink is not None else self._err
        self._stream = self._err  # the one being routed (under the lock)
        self._seen_tracebacks: set[tuple[bytes, ...]] = set()
        self._lock = threading.Lock()

    @property
    def hidden_count(self) -> int:
        return len(self.hidden)

    # -- input -------------------------------------------------------------------
    def consume(self, lines: Iterable[bytes], stdout: bool = False) -> None:
        """Feed every line (run in a thread), then flush what is held."""
        for line in lines:
            self.feed(line, stdout)
        self.close(stdout)

    def consume_fd(self, fd: int, stdout: bool = False) -> None:
        """Read a pipe as data arrives: whole lines are filtered; a partial line (a
        prompt, a progress bar) is passed on at once unless a block is being held."""
        stream = self._out if stdout else self._err
        pending = b""
        while chunk := os.read(fd, 65536):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self.feed(line + b"\n", stdout)
            with self._lock:
                if pending and not stream.holding and not pending.startswith((b"-", b"[", b"T")):
                    self._stream = stream
                    self._write([pending.replace(b"\0", b"")])
                    pending = b""
        if pending:
            self.feed(pending, stdout)
        self.close(stdout)

    def feed(self, raw: bytes, stdout: bool = False) -> None:
        line = raw.replace(b"\0", b"")
        if not line.endswith(b"\n"):
            line += b"\n"
        with self._lock:
            self._stream = self._out if stdout else self._err
            self._note_failure(line)
            self._route(line)

    def close(self, stdout: bool = False) -> None:
        """End of a stream: whatever is still held back is shown as it is."""
        with self._lock:
            stream = self._stream = self._out if stdout else self._err
            if stream.banner is not None:
                self._write(stream.banner)
                stream.banner = None
            for prefix in list(stream.tracebacks):
                self._write([prefix + body for body in stream.tracebacks.pop(prefix)])

    def explain(self) -> None:
        """After a failure with no rank error on screen: the hidden banners explain it."""
        with self._lock:
            self._stream = self._err
            if self.rank_error_shown or not self.hidden:
                return
            for banner in self.hidden:
                self._write(banner)
            self.hidden = []

    # -- routing -------------------------------------------------------------------
    def _note_failure(self, line: bytes) -> None:
        if self.failure is None:
            cause = _failure_in(line)
            if cause is not None:
                self.failure, self.failure_at = cause, time.monotonic()

    def _route(self, line: bytes) -> None:
        match = _PREFIX.match(line)
        prefix = match.group(0) if match else b""
        body = line[len(prefix):]
        if not prefix and self._in_banner(body):
            return
        if not prefix and _MPI_LINE.match(body):
            self._hide([line])
            return
        if prefix in self._stream.tracebacks or body.startswith(_TRACEBACK):
            self._traceback(prefix, body)
            return
        if _RANK_ERROR.search(body):
            self.rank_error_shown = True
        self._write([line])

    def _in_banner(self, body: bytes) -> bool:
        """Collect an MPI help banner (between dashed rules); True if `body` was taken."""
        stream = self._stream
        if stream.banner is None:
            if not _RULE.match(body):
                return False
            stream.banner = [body]
            return True
        stream.banner.append(body)
        if _RULE.match(body):
            banner, stream.banner = stream.banner, None
            if any(_MPI_WORDS.search(line) for line in banner):
                self._hide(banner)
            else:
                self._write(banner)
        elif len(stream.banner) > _MAX_BANNER_LINES:  # not a banner after all
            banner, stream.banner = stream.banner, None
            self._write(banner)
        return True

    def _traceback(self, prefix: bytes, body: bytes) -> None:
        """Hold a traceback until its exception line; show it unless shown already."""
        tracebacks = self._stream.tracebacks
        block = tracebacks.setdefault(prefix, [])
        block.append(body)
        ended = len(block) > 1 and not body[:1].isspace() and not body.startswith(_TRACEBACK)
        if not ended and len(block) < _MAX_TRACEBACK_LINES:
            return
        del tracebacks[prefix]
        self.rank_error_shown = True
        key = tuple(block)
        if key in self._seen_tracebacks:
            last = block[-1].rstrip().decode(errors="replace")
            self._write([prefix + f"(the same traceback as shown above: {last})\n".encode()])
            return
        self._seen_tracebacks.add(key)
        self._write([prefix + b for b in block])

    def _hide(self, lines: list[bytes]) -> None:
        if self.verbose:
            self._write(lines)
        else:
            self.hidden.append(lines)

    def _write(self, lines: list[bytes]) -> None:
        try:
            self._stream.sink.write(b"".join(lines))
            self._stream.sink.flush()
        except (OSError, ValueError):  # the terminal went away; keep draining the pipe
            pass
