"""``keras.callbacks.BackupAndRestore`` under tnt: the master writes, everyone agrees.

Keras' callback reads and writes its backup directory on every process: with several
ranks they race on the same files (or, without a shared disk, disagree about whether a
backup exists and then wait for each other forever). tnt.Model.fit therefore runs every
BackupAndRestore it is given through :class:`DistributedBackup`, which keeps the user's
settings and Keras' file layout (``latest.weights.h5``, ``training_metadata.json``, their
``.bkp`` copies) but

- decides on the master whether and from which epoch to resume, and tells every rank;
- restores the weights (and optimizer state) through ``tnt.Model.load_weights`` (read by
  the master, broadcast), before the first epoch, so fit knows the epoch to start from;
- writes on the master only, atomically, and stamps the epoch *into* the weights file,
  so a job killed between writing the weights and the metadata never resumes the wrong
  epoch with the new weights;
- deletes the directory at the end of training on the master only.

A pipelined model (PIPELINING / ALL) is backed up the same way: the master writes the
serial weights file array by array, each stage sending its variables one at a time
(``_tnt_streamed``: no rank holds the whole model), and restoring
reads each rank's stage from the file (``PipelinedModel.load_weights``); a tensor-parallel
model alike, with its shards joined and each rank reading its slices.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import keras

import tnt_comm

from . import files as _io
from . import internals as _internals
from . import runtime as _runtime
from .log import logger

#: Attribute of the weights file's root group holding the backup's {"epoch", "batch"}.
STAMP = "tnt_backup"


def _stamp(path: str, meta: dict) -> None:
    import h5py

    with h5py.File(path, "a") as f:
        f.attrs[STAMP] = json.dumps(meta)


def _read_stamp(path: Path) -> dict | None:
    import h5py

    with h5py.File(path, "r") as f:  # OSError if the file is not a readable HDF5 file
        raw = f.attrs.get(STAMP)
    return None if raw is None else json.loads(raw)


class DistributedBackup(keras.callbacks.Callback):
    """Runs ``callback``'s backups with master-only, atomic files (see module doc)."""

    def __init__(self, callback: keras.callbacks.BackupAndRestore) -> None:
        super().__init__()
        self.callback = callback
        self.dir = Path(callback.backup_dir)
        weights, metadata = _internals.backup_paths(callback)
        self.weights, self.metadata = Path(weights), Path(metadata)
        self.save_freq = callback.save_freq
        self._current_epoch = 0
        self._last_batch_seen = 0
        self._since_last_save = 0

    # -- restoring (called by tnt.Model.fit before Keras' loop) ----------------------
    def _choose(self) -> tuple[str | None, int | None]:
        """On the master: the weights file to load (or None) and the epoch to start at."""
        for weights, metadata in ((self.weights, self.metadata),
                                  (Path(f"{self.weights}.bkp"), Path(f"{self.metadata}.bkp"))):
            if not weights.exists():
                if metadata.exists():
                    return None, int(json.loads(metadata.read_text())["epoch"])
                continue
            try:
                meta = _read_stamp(weights)
            except OSError as err:  # unreadable: Keras then falls back to the .bkp copy
                logger.warning("BackupAndRestore: cannot read %s (%s); trying the previous backup.", weights, err)
                continue
            if meta is None and metadata.exists():  # written by plain Keras
                meta = json.loads(metadata.read_text())
            if weights != self.weights:  # as Keras: the previous backup becomes the latest
                for src, dst in ((weights, self.weights), (metadata, self.metadata)):
                    if src.exists():
                        _io.write_atomically(dst, lambda tmp, s=src: shutil.copyfile(s, tmp))
            return os.fspath(self.weights), None if meta is None else int(meta["epoch"])
        return None, None

    def restore(self, model) -> int | None:
        """Load the backup on every rank; the epoch to resume at, or None (no backup)."""
        choice: tuple[str | None, int | None] | str = (None, None)
        if _runtime.is_master_rank():
            try:
                choice = self._choose()
            except (OSError, ValueError, KeyError) as err:
                choice = f"{type(err).__name__}: {err}"
        if _runtime.get_size() > 1:
            choice = tnt_comm.broadcast_object(choice, _runtime.MASTER_RANK)
        if isinstance(choice, str):
            raise RuntimeError(f"BackupAndRestore: cannot read the backup in {self.dir}: {choice}")
        weights, epoch = choice
        if weights is not None:
            model.load_weights(weights)
        if epoch is not None:
            self._current_epoch = epoch
            logger.info("BackupAndRestore: resuming at epoch %d from %s", epoch, self.dir)
        return epoch

    # -- saving ----------------------------------------------------------------------
    def on_epoch_end(self, epoch, logs=None):
        self._current_epoch = epoch + 1
        self._last_batch_seen = 0
        if self.save_freq == "epoch":
            self._save()

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch" or self.save_freq is False:
            return
        # Keras' counting, which also holds with steps_per_execution > 1.
        added = batch + 1 if batch <= self._last_batch_seen else batch - self._last_batch_seen
        self._since_last_save += added
        self._last_batch_seen = batch
        if self._since_last_save >= self.save_freq:
            self._since_last_save = 0
            self._save()

    def _save(self) -> None:
        meta = {"epoch": self._current_epoch, "batch": self._last_batch_seen}
        # Replicas' batch-norm moving statistics averaged, as before every save (one model).
        getattr(self.model, "_tnt_before_save", lambda: None)()
        # A sharded model's master holds the whole optimizer state while it writes.
        with getattr(self.model, "_tnt_serial_state", contextlib.nullcontext)():
            self._write(meta)
        if _runtime.get_size() > 1:
            tnt_comm.barrier()

    def _write(self, meta: dict) -> None:
        streamed = getattr(self.model, "_tnt_streamed", None)
        stream = streamed("weights", True) if streamed is not None else None
        inner = _serial_model(self.model) if stream is None else None
        if stream is not None:  # the stages answer the master's requests, then wait for it
            stream.serve()
        if _runtime.is_master_rank():
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.callback.double_checkpoint:
                for path in (self.weights, self.metadata):
                    if path.exists():
                        _io.write_atomically(f"{path}.bkp", lambda tmp, p=path: shutil.copyfile(p, tmp))

            def write_weights(tmp: str) -> None:
                if stream is not None:
                    stream.write(tmp)
                else:
                    inner.save_weights(tmp)
                _stamp(tmp, meta)

            _io.write_atomically(self.weights, write_weights)
            _io.write_atomically(self.metadata, lambda tmp: Path(tmp).write_text(json.dumps(meta)))

    def on_train_end(self, logs=None):
        if self.callback.delete_checkpoint and _runtime.is_master_rank():
            shutil.rmtree(self.dir, ignore_errors=True)
        if _runtime.get_size() > 1:
            tnt_comm.barrier()


def _serial_model(model) -> keras.Model | None:
    """What the backup writes: the wrapped model, or a pipelined model's stages (a
    tensor-parallel model's shards) gathered on the master (every rank takes part; None off
    the master)."""
    gather = getattr(model, "_tnt_gather_serial", None)
    return gather() if gather is not None else model.model


def adapt(callbacks) -> tuple[list | None, DistributedBackup | None]:
    """``callbacks`` with a BackupAndRestore replaced by its DistributedBackup."""
    if callbacks is None:
        return None, None
    out, backup = [], None
    for cb in callbacks:
        if isinstance(cb, keras.callbacks.BackupAndRestore):
            if backup is not None:
                raise ValueError("fit() got two BackupAndRestore callbacks; pass one.")
            cb = backup = DistributedBackup(cb)
        out.append(cb)
    return out, backup
