"""The one base of every distributed model: what a layout does not change, written once.

A layout (data replicas, pipeline stages, tensor shards, or their product) says only how
it gathers the serial model on the master (``_tnt_gather_serial``) or streams its file
there array by array (``_tnt_streamed``), how it reads a serial
file into its own part (``load_weights``) and what it prints as its summary. Everything
else — files written by the master atomically, ``overwrite``, ``export`` of a
whole-model SavedModel, per-rank copies (``tnt_save_all_devices``), progress on the
master only, callbacks per rank, the common shuffle seed, serial-shaped ``get_weights`` /
``set_weights`` — is here, alike for every
layout (docs/architecture.md, "Strategies").
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np

import tnt_comm

from . import files as _io
from . import inputs as _inputs
from . import memory as _memory
from . import py_inputs as _py_inputs
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

    def _tnt_streamed(self, kind: str, with_optimizer: bool):
        """A streamed write of the serial file (``_core.streamed_files.StreamedWrite``:
        no rank holds the whole model), or None to gather the serial model on the master
        instead; ``kind``: "model" (.keras) or "weights" (.weights.h5). Every rank calls it."""
        return None

    def _tnt_summary(self, *args, **kwargs) -> None:
        """What ``summary`` prints on the master."""
        raise NotImplementedError

    def _tnt_before_save(self) -> None:
        """Make the state a file holds global (data parallelism: moving statistics)."""

    def _tnt_serial_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the serial model's ``get_weights()``, in its order (no collective)."""
        raise NotImplementedError

    def _tnt_assign_serial(self, weights: list[np.ndarray]) -> None:
        """Keep this rank's part of the serial-shaped ``weights`` (checked, the master's
        on every rank): a stage's layers, a shard's slices, the whole of a replica."""
        raise NotImplementedError

    def _tnt_serial_weights(self) -> list[np.ndarray]:
        """The serial model's weights on every rank, its order and shapes (every rank calls it)."""
        raise NotImplementedError

    # -- serial-shaped weights -----------------------------------------------------------------
    def get_weights(self) -> list[np.ndarray]:
        """The serial model's ``get_weights()`` (its order and shapes) on every rank,
        whatever the layout; every rank calls it (a collective)."""
        return [np.asarray(w) for w in self._tnt_serial_weights()]

    def set_weights(self, weights) -> None:
        """Set the weights from a serial-shaped list (the serial model's ``get_weights()``
        order and shapes); every rank calls it and keeps its part of the master's list.
        A list of another length or shape raises ValueError on every rank."""
        expected = self._tnt_serial_shapes()
        problem = serial_weights_problem(weights, expected)
        several = _runtime.get_size() > 1
        problems = tnt_comm.allgather_object(problem) if several else [problem]
        bad = [(r, p) for r, p in enumerate(problems) if p is not None]
        if bad:
            rank, what = bad[0]
            raise ValueError(
                f"set_weights() on rank {rank}: {what}. It takes the serial model's weights as "
                f"serial Keras' get_weights() returns them: {len(expected)} arrays of shapes "
                f"{[tuple(s) for s in expected]} (e.g. model.get_weights() of this model or of "
                "the serial Keras model it wraps).")
        weights = [np.asarray(w) for w in weights]
        if several:
            weights = tnt_comm.broadcast_object(weights if _runtime.is_master_rank() else None,
                                                _runtime.get_master_rank())
        self._tnt_assign_serial(weights)

    # -- the loops' common pieces ---------------------------------------------------------------
    def _verbose(self, verbose):
        """Progress on the master only."""
        return verbose if _runtime.is_master_rank() else 0

    @contextlib.contextmanager
    def _rank_callbacks(self, callbacks):
        """``callbacks`` as this rank runs them (writers on the master; see _rank_callbacks);
        an input error raised while a batch was read comes out as InputError (py_inputs)."""
        with _py_inputs.input_errors(), callbacks_for_rank(
                callbacks, tensorboard_on_all_ranks=self._tnt_settings.tensorboard_on_all_devices) as cbs:
            yield cbs

    def _common_seed(self) -> int:
        """One shuffle seed for every rank of the job (drawn once, on the master)."""
        if getattr(self, "_tnt_seed", None) is None:
            self._tnt_seed = _inputs.common_seed()
        return self._tnt_seed

    # -- memory (docs/memory.md) ----------------------------------------------------------------
    def _tnt_memory_layout(self) -> _memory.Holdings:
        """What this rank holds (each layout says it; the estimate is counted from it)."""
        raise NotImplementedError

    def memory_report(self) -> dict:
        """This rank's memory: the plan's estimate by category (bytes), its total, and the
        measured peak (max RSS - RSS after ``import tarantella`` on CPU, TensorFlow's peak
        on a GPU). Local: no collective. ``TNT_MEMORY_REPORT=1`` prints every rank's at
        the end of ``fit`` on the master."""
        return _memory.report(self)

    def _tnt_memory_before_fit(self, x, batch_size) -> None:
        """Remember the global batch (activations per micro-batch) and check the memory
        budget on every rank (``memory_budget=`` / ``TNT_MEMORY_BUDGET``) before training."""
        self._tnt_memory_global_batch = _memory.global_batch(x, batch_size)
        _memory.check_budget(self, getattr(self, "_tnt_memory_budget", None) or _memory.budget_from(None))

    def fit(self, *args, **kwargs):
        """Keras' fit (each layout prepares its data first), then ``TNT_MEMORY_REPORT``."""
        history = super().fit(*args, **kwargs)
        _memory.print_report_if_asked(self)
        return history

    def summary(self, *args, **kwargs) -> None:
        """The layout's summary, printed on the master."""
        if _runtime.is_master_rank():
            self._tnt_summary(*args, **kwargs)

    # -- files ---------------------------------------------------------------------------------------
    def _write(self, filepath, overwrite: bool, all_devices: bool, with_optimizer: bool, write,
               kind: str | None = None) -> None:
        if not _io.may_write(filepath, overwrite, all_devices):
            return
        self._tnt_before_save()
        stream = self._tnt_streamed(kind, with_optimizer) if kind is not None else None
        if stream is not None:  # the master writes array by array; the holders answer it first
            stream.serve()
            if all_devices and _runtime.get_size() > 1 and not self._tnt_whole_on_every_rank:
                _io.copies_from_master(filepath, stream.write)
            else:
                _io.save_on_master(filepath, stream.write, all_devices=all_devices)
            return
        full = self._tnt_gather_serial(with_optimizer=with_optimizer)
        if all_devices and _runtime.get_size() > 1 and not self._tnt_whole_on_every_rank:
            _io.copies_from_master(filepath, lambda tmp: write(full, tmp))
        else:
            _io.save_on_master(filepath, lambda tmp: write(full, tmp), all_devices=all_devices)

    def save(self, filepath, overwrite=True, *, tnt_save_all_devices=False, **kwargs) -> None:
        """One plain serial ``.keras`` file (with the optimizer state), written by the master
        atomically; every rank calls it. ``tnt_save_all_devices=True``: every rank writes its
        own copy ``<name>.rank<r>.keras`` (nodes without a shared disk). Layouts that split
        the model stream it to the master array by array (``_tnt_streamed``)."""
        kind = "model" if not kwargs and str(filepath).endswith(".keras") else None
        self._write(filepath, overwrite, tnt_save_all_devices, True,
                    lambda full, tmp: full.save(tmp, overwrite=True, **kwargs), kind)

    def save_weights(self, filepath, overwrite=True, *, tnt_save_all_devices=False, **kwargs) -> None:
        """The serial ``.weights.h5`` (with the optimizer state, as Keras writes it for a
        compiled model), written by the master atomically; every rank calls it."""
        kind = "weights" if not kwargs and str(filepath).endswith(".weights.h5") else None
        self._write(filepath, overwrite, tnt_save_all_devices, True,
                    lambda full, tmp: full.save_weights(tmp, overwrite=True, **kwargs), kind)

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


def serial_weights_problem(weights, expected: list[tuple[int, ...]]) -> str | None:
    """What is wrong with ``weights`` as a list of arrays of the ``expected`` shapes (None: fine)."""
    if isinstance(weights, np.ndarray | str | bytes | dict) or not hasattr(weights, "__len__"):
        return f"got {type(weights).__name__}, not a list of arrays"
    if len(weights) != len(expected):
        return f"got a list of {len(weights)} arrays, the model has {len(expected)} weights"
    for j, (w, shape) in enumerate(zip(weights, expected)):
        try:
            got = tuple(np.shape(w))
        except (TypeError, ValueError) as err:  # ragged nesting: no shape (fails on every rank alike)
            return f"array {j} has no shape ({err})"
        if got != tuple(shape):
            return f"array {j} has shape {got}, the model's weight {j} has shape {tuple(shape)}"
    return None


__all__ = ["DistributedModel", "serial_weights_problem"]
