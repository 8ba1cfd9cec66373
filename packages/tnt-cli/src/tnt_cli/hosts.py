"""Hostfiles and the placement of ranks on hosts (pure functions, no processes)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from tnt_cli.errors import UsageError

_HOST = re.compile(r"[A-Za-z0-9_.\-]+\Z")
_HOST_COLON_SLOTS = re.compile(r"([^:]+):(\d+)\Z")  # MPICH machinefile form 'host:K'



@dataclass(frozen=True)
class Host:
    """One hostfile line: a host name and, when given, its number of slots."""

    name: str
    slots: int | None = None


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[Host]:
    """Parse `host`, `host slots=K` (Open MPI) and `host:K` (MPICH) lines.

    `#` starts a comment; blank lines are skipped.
    """
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        name, *rest = line.split()
        colon_slots: int | None = None
        if match := _HOST_COLON_SLOTS.match(name):
            name, colon_slots = match.group(1), int(match.group(2))
            if colon_slots < 1:
                raise UsageError(f"{where}: slots must be a positive integer, got {colon_slots}")
        if not _HOST.match(name):
            raise UsageError(f"{where}: {name!r} is not a host name")
        slots: int | None = colon_slots
        for field in rest:
            key, sep, value = field.partition("=")
            if key not in ("slots", "max_slots", "max-slots") or not sep:
                raise UsageError(
                    f"{where}: cannot read {field!r}; lines are 'host' or 'host slots=K'"
                )
            if key != "slots":
                continue  # max_slots is an Open MPI limit; we place by slots
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"{where}: slots must be a positive integer, got {value!r}")
            slots = int(value)
        if name in seen:
            raise UsageError(
                f"{where}: host {name!r} is listed twice (first on line {seen[name]}); "
                f"list it once, with 'slots=K' for K processes"
            )
        seen[name] = lineno
        hosts.append(Host(name, slots))
    if not hosts:
        raise UsageError(f"{source}: no hosts listed")
    return hosts


def read_hostfile(path: str | os.PathLike[str]) -> list[Host]:
    """Read and parse a hostfile; an unreadable file is a one-line error."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"cannot read hostfile {os.fspath(path)!r}: {reason}") from exc
    return parse_hostfile_text(text, source=os.fspath(path))


@dataclass(frozen=True)
class Placement:
    """How many ranks run on which host; `local` means this machine only, no host list."""

    counts: tuple[tuple[str, int], ...]
    local: bool
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return sum(count for _, count in self.counts)

    @property
    def uniform(self) -> int | None:
        """The common per-host count when every host runs the same number of ranks."""
        values = {count for _, count in self.counts}
        return values.pop() if len(values) == 1 else None


def local_cores() -> int:
    """CPU cores this process may run on (respects affinity masks and cgroups' cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def place_ranks(
    hosts: list[Host] | None,
    n: int | None,
    n_per_node: int | None,
    gpus_per_node: int = 0,
    cores: int | None = None,
) -> Placement:
    """Decide the rank count per host.

    - `n_per_node` K: K on every host (with `n`, it must equal K x hosts).
    - `n` only: fill hosts up to their slots when every host gives slots, the rest
      round-robin (oversubscribed); otherwise spread evenly, first hosts get one more.
    - neither: one rank per GPU, else each host's slots, else one per host (warning).
    `hosts=None` means this machine only.
    """
    local = hosts is None
    host_list = hosts if hosts is not None else [Host("localhost", None)]
    count_hosts = len(host_list)
    warnings: list[str] = []
    if n_per_node is not None:
        if n is not None and n != n_per_node * count_hosts:
            raise UsageError(
                f"-n {n} conflicts with --n-per-node {n_per_node} on {count_hosts} "
                f"host(s) ({n_per_node * count_hosts} processes); give only one of them"
            )
        counts = [n_per_node] * count_hosts
    elif n is not None:
        counts = _spread(host_list, n)
    elif gpus_per_node > 0:
        counts = [gpus_per_node] * count_hosts
    else:
        counts = [h.slots or 1 for h in host_list]
        if any(h.slots is None for h in host_list):
            warnings.append(
                "no -n or --n-per-node given and no GPU found: starting one process per "
                "host; use -n N (one host) or --n-per-node K to choose"
            )
    notes = _oversubscription_notes(host_list, counts, local, cores)
    pairs = tuple((h.name, c) for h, c in zip(host_list, counts) if c > 0)
    return Placement(pairs, local, tuple(notes), tuple(warnings))


def _spread(hosts: list[Host], n: int) -> list[int]:
    if all(h.slots is not None for h in hosts):
        counts: list[int] = []
        remaining = n
        for host in hosts:
            take = min(host.slots or 0, remaining)
            counts.append(take)
            remaining -= take
        for i in range(remaining):  # more ranks than slots: round-robin the rest
            counts[i % len(hosts)] += 1
        return counts
    base, rest = divmod(n, len(hosts))
    return [base + (1 if i < rest else 0) for i in range(len(hosts))]


def _oversubscription_notes(
    hosts: list[Host], counts: list[int], local: bool, cores: int | None
) -> list[str]:
    notes: list[str] = []
    if local:
        available = cores if cores is not None else local_cores()
        if counts[0] > available:
            notes.append(
                f"{counts[0]} processes on {available} core(s): oversubscribing; "
                "expect each process to run slower"
            )
        return notes
    for host, count in zip(hosts, counts):
        if host.slots is not None and count > host.slots:
            notes.append(
                f"{count} processes on {host.name} with slots={host.slots}: oversubscribing"
            )
    return notes


def is_oversubscribed_locally(placement: Placement, cores: int | None = None) -> bool:
    """True when a local-only run starts more ranks than this machine has cores."""
    available = cores if cores is not None else local_cores()
    return placement.local and placement.total > available
