"""Files: written by the master rank only and atomically; read once and shared.

Writing goes to a temporary file in the target directory, then ``os.replace`` puts it in
place, so a job killed mid-save never leaves a truncated file where the last good one was.
Reading is done by the master, which broadcasts the bytes: ranks on nodes without a
shared file system load the same file, and no rank reads a file another rank is writing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

import tnt_comm

from . import internals as _internals
from .runtime import MASTER_RANK, get_rank, get_size

# Keras decides the format from the file name, so temporary names keep the suffix.
_SUFFIXES = (".weights.h5", ".keras", ".h5", ".json")


def _suffix(path: Path) -> str:
    name = path.name
    return next((s for s in _SUFFIXES if name.endswith(s)), path.suffix)


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` and move the result to ``path`` in one rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=f".tmp{_suffix(target)}", dir=target.parent
    )
    os.close(fd)
    os.unlink(tmp)  # Keras refuses to overwrite without asking; let it create the file
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save_on_master(path, write: Callable[[str], None], all_devices: bool = False) -> None:
    """Write on the master rank (or on each rank into its own file), then wait for it."""
    if all_devices and get_size() > 1:
        target = Path(path)
        suffix = _suffix(target)
        stem = target.name[: -len(suffix)] if suffix else target.name
        write_atomically(target.with_name(f"{stem}.rank{get_rank()}{suffix}"), write)
    elif get_rank() == MASTER_RANK:
        # The others wait in the barrier meanwhile: a long write is not a stall.
        with tnt_comm.long_local_work():
            write_atomically(path, write)
    if get_size() > 1:
        tnt_comm.barrier()


@contextlib.contextmanager
def master_file(path: str | os.PathLike) -> Iterator[str]:
    """A local path holding the master rank's copy of ``path`` (all ranks call this)."""
    if get_size() == 1:
        yield os.fspath(path)
        return
    target = Path(path)
    data = np.zeros(0, dtype=np.uint8)
    error = None
    if get_rank() == MASTER_RANK:
        try:
            data = np.frombuffer(target.read_bytes(), dtype=np.uint8)
        except OSError as err:
            error = f"{type(err).__name__}: {err}"
    error = tnt_comm.broadcast_object(error, MASTER_RANK)
    if error is not None:
        raise FileNotFoundError(f"rank 0 could not read {target}: {error}")
    length = int(tnt_comm.broadcast(np.array([data.size], dtype=np.int64), MASTER_RANK)[0])
    if get_rank() != MASTER_RANK:
        data = np.zeros(length, dtype=np.uint8)
    data = tnt_comm.broadcast(data, MASTER_RANK)
    if get_rank() == MASTER_RANK:
        yield os.fspath(target)
        return
    with tempfile.TemporaryDirectory(prefix="tnt-load-") as tmp:
        local = Path(tmp) / target.name
        local.write_bytes(data.tobytes())
        yield os.fspath(local)


def may_write(path, overwrite: bool, all_devices: bool = False) -> bool:
    """Whether a save to ``path`` goes ahead, decided alike on every rank (collective).

    With ``overwrite=False`` and an existing file, Keras asks on the terminal; so does the
    master here when its input is a terminal (the answer reaches every rank), and
    otherwise every rank raises FileExistsError: a job has nobody to ask.
    """
    if overwrite:
        return True
    target = Path(path)
    if all_devices and get_size() > 1:
        suffix = _suffix(target)
        stem = target.name[: -len(suffix)] if suffix else target.name
        target = target.with_name(f"{stem}.rank{get_rank()}{suffix}")
    decision = "write"
    if target.exists():
        decision = "exists"
        if get_rank() == MASTER_RANK and not all_devices and sys.stdin is not None and sys.stdin.isatty():
            decision = "write" if _internals.ask_to_overwrite(os.fspath(target)) else "skip"
    if get_size() > 1:
        everyone = tnt_comm.allgather_object(decision)
        decision = "exists" if "exists" in everyone[1:] or (all_devices and "exists" in everyone) \
            else everyone[MASTER_RANK]
    if decision == "exists":
        raise FileExistsError(
            f"{os.fspath(target)} already exists and overwrite=False. Pass overwrite=True to replace it "
            "(or save under another name); Keras would ask on the terminal, which a launched job cannot.")
    return decision == "write"


def copies_from_master(path, write: Callable[[str], None]) -> None:
    """Every rank gets its own file ``<stem>.rank<r><suffix>`` of what ``write`` makes on the
    master (for layouts where only the master holds the whole model; collective)."""
    target = Path(path)
    suffix = _suffix(target)
    stem = target.name[: -len(suffix)] if suffix else target.name
    data = np.zeros(0, dtype=np.uint8)
    if get_rank() == MASTER_RANK:
        with tempfile.TemporaryDirectory(prefix="tnt-save-") as tmp, tnt_comm.long_local_work():
            made = Path(tmp) / target.name
            write(os.fspath(made))
            data = np.frombuffer(made.read_bytes(), dtype=np.uint8)
    if get_size() > 1:
        length = int(tnt_comm.broadcast(np.array([data.size], dtype=np.int64), MASTER_RANK)[0])
        if get_rank() != MASTER_RANK:
            data = np.zeros(length, dtype=np.uint8)
        data = tnt_comm.broadcast(data, MASTER_RANK)
    write_atomically(target.with_name(f"{stem}.rank{get_rank()}{suffix}"),
                     lambda tmp: Path(tmp).write_bytes(data.tobytes()))
    if get_size() > 1:
        tnt_comm.barrier()
