"""The one base of every distributed model: what a layout does not change, written once.

A layout (data replicas, pipeline stages, tensor shards, or their product) says only how
it gathers the serial model on the master (``_tnt_gather_serial``), how it reads a serial
file into its own part (``load_weights``) and what it prints as its summary. Everything
else — files written by the master atomically, ``overwrite``, ``export`` of a
whole-model SavedModel, per-rank copies (``tnt_save_all_devices``), progress on the
master only, callbacks per rank, the common shuffle seed — is here, alike for every
layout (docs/architecture.md, "Strategies").
"""

from __future__ import annotations

import keras

import tnt_comm

from . import files as _io
from . import inputs as _inputs
from . import runtime as _runtime
from .rank_callbacks import callbacks_for_rank


class DistributedModel(keras.Model):
    """A ``keras.Model`` whose fit/evaluate/predict run on every rank of the job."""

    #: Whether every rank holds the whole serial model (data parallelism): then each rank
    #: can write its own copy without gathering.
    _tnt_whole_on_every_rank = False

    # -- what a layout provides --------------------------------------------------------------
    def _tnt_gather_serial(self, with_optimizer: bool = True) -> keras.Model | None:
        """The whole serial model (with the optimizer state when compiled) on the master,
        None elsewhere; every rank calls it (BackupAndRestore and every file use it)."""
        raise NotImplementedError

    def _tnt_summary(self, *args, **kwargs) -> None:
        """What ``summary`` prints on the master."""
        raise NotImplementedError

    def _tnt_before_save(self) -> None:
        """Make the state a file holds global (data parallelism: moving statistics)."""

    # -- the loops' common pieces ---------------------------------------------------------------
    def _verbose(self, verbose):
        """Progress on the master only."""
        return verbose if _runtime.is_master_rank() else 0

    def _rank_callbacks(self, callbacks):
        """``callbacks`` as this rank runs them (writers on the master; see _rank_callbacks)."""
        return callbacks_for_rank(callbacks,
                                  tensorboard_on_all_ranks=self._tnt_settings.tensorboard_on_all_devices)

    def _common_seed(self) -> int:
        """One shuffle seed for every rank of the job (drawn once, on the master)."""
        if getattr(self, "_tnt_seed", None) is None:
            self._tnt_seed = _inputs.common_seed()
        return self._tnt_seed

    def summary(self, *args, **kwargs) -> None:
        """The layout's summary, printed on the master."""
        if _runtime.is_master_rank():
            self._tnt_summary(*args, **kwargs)

    # -- files ---------------------------------------------------------------------------------------
    def _write(self, filepath, overwrite: bool, all_devices: bool, with_optimizer: bool, write) -> None:
        if not _io.may_write(filepath, overwrite, all_devices):
            return
        self._tnt_before_save()
        full = self._tnt_gather_serial(with_optimizer=with_optimizer)
        if all_devices and _runtime.get_size() > 1 and not self._tnt_whole_on_every_rank:
            _io.copies_from_master(filepath, lambda tmp: write(full, tmp))
        else:
            _io.save_on_master(filepath, lambda tmp: write(full, tmp), all_devices=all_devices)

    def save(self, filepath, overwrite=True, *, tnt_save_all_devices=False, **kwargs) -> None:
        """One plain serial ``.keras`` file (with the optimizer state), written by the master
        atomically; every rank calls it. ``tnt_save_all_devices=True``: every rank writes its
        own copy ``<name>.rank<r>.keras`` (nodes without a shared disk)."""
        self._write(filepath, overwrite, tnt_save_all_devices, True,
                    lambda full, tmp: full.save(tmp, overwrite=True, **kwargs))

    def save_weights(self, filepath, overwrite=True, *, tnt_save_all_devices=False, **kwargs) -> None:
        """The serial ``.weights.h5`` (with the optimizer state, as Keras writes it for a
        compiled model), written by the master atomically; every rank calls it."""
        self._write(filepath, overwrite, tnt_save_all_devices, True,
                    lambda full, tmp: full.save_weights(tmp, overwrite=True, **kwargs))

    def export(self, filepath, format="tf_saved_model", verbose=True, **kwargs) -> None:
        """Keras' ``export`` of the whole serial model (a SavedModel serving the serial
        outputs, whatever the layout), written by the master; every rank calls it."""
        self._tnt_before_save()
        full = self._tnt_gather_serial(with_optimizer=False)
        if _runtime.is_master_rank():
            with tnt_comm.long_local_work():  # the others wait in the barrier meanwhile
                full.export(filepath, format=format, verbose=verbose, **kwargs)
        if _runtime.get_size() > 1:
            tnt_comm.barrier()


__all__ = ["DistributedModel"]
