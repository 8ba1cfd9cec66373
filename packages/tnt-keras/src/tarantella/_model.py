"""``tnt.Model``: a Keras model that trains data-parallel on every rank of the job.

The wrapper is itself a ``keras.Model`` so that Keras' own fit/evaluate/predict loops,
callbacks and progress bars drive it unchanged; it owns no layers of its own. The
wrapped model keeps everything a user saves or inspects — layers, weights, optimizer,
compiled loss and metrics — so files written by ``tnt.Model.save`` are plain Keras files.
What the wrapper changes is where data comes from (this rank's micro-batches), how a step
ends (fused allreduce of gradients and metric states, see ``_steps``), who writes files
(the master rank, atomically) and that all replicas start from rank 0's state.
"""

from __future__ import annotations

import enum
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_comm
import tnt_data

from . import _backup, _io, _runtime, _sync
from ._inputs import DEFAULT_BATCH_SIZE as _DEFAULT_BATCH_SIZE
from ._inputs import InputError, Sharding, global_batch_size, rank_dataset
from ._logging import logger
from ._rank_callbacks import callbacks_for_rank
from ._steps import DistributedSteps, split_sizes

_BATCH_NORM_MIN_LOCAL_BATCH = 16


class ParallelStrategy(enum.Enum):
    """How the model is parallelised: DATA, PIPELINING (N == p stages), ALL (N/p pipelines)."""

    DATA = "data"
    PIPELINING = "pipelining"
    ALL = "all"


class Model(keras.Model):
    """Wrap ``model`` so that compile/fit/evaluate/predict run on all ranks of the job.

    Args:
        model: a built or unbuilt Keras 3 model (Sequential, functional or subclassed).
        parallel_strategy: ``tnt.ParallelStrategy.DATA`` (the only one supported).
    """

    def __new__(cls, *args, **kwargs):
        # PIPELINING / ALL on several ranks and stages build a pipelined model instead.
        from .pipelining import pipelined_model

        pipelined = pipelined_model(*args, strategies=ParallelStrategy, **kwargs)
        return pipelined if pipelined is not None else super().__new__(cls, *args, **kwargs)

    def __init__(self, model: keras.Model, parallel_strategy=ParallelStrategy.DATA, **kwargs):
        if not isinstance(model, keras.Model):
            raise TypeError(
                f"tnt.Model wraps a keras.Model, got {type(model).__name__}. "
                "Build the Keras model first, then pass it: tnt.Model(keras_model)."
            )
        if isinstance(model, Model):
            raise TypeError("This model is already a tnt.Model; wrap the Keras model only once.")
        if ParallelStrategy(parallel_strategy) is not ParallelStrategy.DATA:  # 1 rank or 1 stage
            kwargs = {k: v for k, v in kwargs.items() if not k.startswith(("num_pipeline", "num_micro", "pipeline_"))}
        super().__init__(name=f"tnt_{model.name}", **kwargs)
        self._tnt_settings = _runtime.setup()
        self._model = model
        self._tnt_steps = DistributedSteps(
            model, _runtime.get_size(), self._tnt_settings.fusion_threshold_bytes
        )
        self._tnt_synced = False
        self._tnt_seed: int | None = None
        if model.built:
            self.built = True
        if model.compiled:  # e.g. loaded from a .keras file with its training config
            self._compile_wrapper(model.run_eagerly, model.steps_per_execution)

    # -- what the wrapped model is -------------------------------------------------
    @property
    def model(self) -> keras.Model:
        """The wrapped Keras model (serial view: same weights on every rank)."""
        return self._model

    def call(self, inputs, training=None, mask=None):
        return self._model(inputs, training=training)

    @property
    def layers(self):
        return self._model.layers

    @property
    def metrics(self):
        return self._model.metrics

    @property
    def metrics_names(self):
        return self._model.metrics_names

    def get_config(self) -> dict[str, Any]:
        return self._model.get_config()

    def to_json(self, **kwargs) -> str:
        return self._model.to_json(**kwargs)

    def summary(self, *args, **kwargs) -> None:
        if _runtime.is_master_rank():
            self._model.summary(*args, **kwargs)

    def get_weights(self):
        return self._model.get_weights()

    def set_weights(self, weights) -> None:
        """Set the weights on the master and broadcast them, so all replicas agree."""
        self._model.set_weights(weights)
        if _runtime.get_size() > 1:
            _sync.broadcast_from_master(self._model.weights)

    def __getattr__(self, name: str):
        # Attributes defined by a subclassed model (e.g. `model.encoder`) stay reachable.
        if name.startswith("_"):
            raise AttributeError(name)
        inner = self.__dict__.get("_model")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    # -- compile ----------------------------------------------------------------------
    def compile(self, optimizer="rmsprop", loss=None, *, jit_compile="auto",
                run_eagerly=False, steps_per_execution=1, **kwargs) -> None:
        """Compile the wrapped model; the wrapper's steps use its loss, metrics, optimizer.

        ``jit_compile`` is honoured: on one rank as Keras does; on several ranks XLA
        compiles the part of each step before the gradient exchange and the part after it
        (the exchange itself runs outside the compiler).
        """
        self._model.compile(
            optimizer=optimizer, loss=loss, run_eagerly=run_eagerly,
            steps_per_execution=steps_per_execution, jit_compile=jit_compile, **kwargs,
        )
        self._compile_wrapper(run_eagerly, steps_per_execution)

    def _compile_wrapper(self, run_eagerly: bool, steps_per_execution: int) -> None:
        """Let Keras' loops run on the wrapper, with the wrapped model's optimizer.

        On several ranks the wrapper's step function itself is not XLA-compiled (it holds
        the exchange); DistributedSteps compiles the halves around it instead.
        """
        jit = False if _runtime.get_size() > 1 else self._model.jit_compile
        super().compile(
            optimizer=self._model.optimizer, loss=None, run_eagerly=run_eagerly,
            steps_per_execution=steps_per_execution, jit_compile=jit,
        )
        self._tnt_steps.close()
        self._tnt_steps = DistributedSteps(
            self._model, _runtime.get_size(), self._tnt_settings.fusion_threshold_bytes
        )
        self._tnt_synced = False

    @property
    def optimizer(self):
        return self._model.optimizer if self._model.compiled else None

    @optimizer.setter
    def optimizer(self, value) -> None:
        # Keras' compile assigns it; the wrapped model owns the optimizer.
        pass

    def _assert_compiled(self, method: str) -> None:
        if not self._model.compiled or not self.compiled:
            raise RuntimeError(
                f"tnt.Model.{method}() needs a compiled model: call model.compile(optimizer, "
                "loss, metrics) first. A model loaded with compile=False, or whose file has no "
                "training configuration, must be compiled after loading."
            )

    # -- steps (called by Keras' loops) --------------------------------------------------
    def train_step(self, data):
        return self._tnt_steps.train_step(data)

    def test_step(self, data):
        return self._tnt_steps.test_step(data)

    def predict_step(self, data):
        return self._tnt_steps.predict_step(data)

    # -- preparing a run -------------------------------------------------------------------
    def _common_seed(self) -> int:
        """The shuffle seed of unseeded shuffles (and of array inputs), equal on all ranks.

        Derived from TensorFlow's global seed when one is set (``keras.utils.set_random_seed``
        or ``tf.random.set_seed``), so that every run of the script, a resumed one too,
        shuffles alike; otherwise drawn at random. Rank 0's choice is used everywhere.
        """
        if self._tnt_seed is None:
            seed = _global_seed()
            if seed is None:
                seed = int(np.random.SeedSequence().entropy % (2**31 - 1))
            else:
                seed = int(np.random.SeedSequence([seed, _SEED_SALT]).generate_state(1)[0] % (2**31 - 1))
            if _runtime.get_size() > 1:
                seed = tnt_comm.broadcast_object(seed, _runtime.MASTER_RANK)
            self._tnt_seed = int(seed)
        return self._tnt_seed

    def _sharding(self, distribute: bool, micro_batch_size: int | None) -> Sharding:
        return Sharding(
            rank=_runtime.get_rank(), size=_runtime.get_size(), distribute=distribute,
            micro_batch_size=micro_batch_size, shuffle_seed=self._common_seed(),
        )

    def _build_from(self, dataset: tf.data.Dataset, with_metrics: bool) -> None:
        """Create every variable (model, metrics, optimizer) before any step is traced.

        The step functions read and reduce metric and optimizer state, so these must
        exist on every rank before the first step, built from the element spec with a
        one-sample batch (no data is consumed).
        """
        model = self._model
        optimizer = model.optimizer if model.compiled else None
        if (model.built and self.built
                and (not with_metrics or all(getattr(m, "built", True) for m in model.metrics))
                and (not with_metrics or optimizer is None or optimizer.built)):
            return  # nothing left to create: skip the eager forward pass
        spec, _ = split_sizes(dataset.element_spec)

        def zeros(s):
            if not isinstance(s, tf.TensorSpec):
                return s
            shape = [1 if d is None else d for d in s.shape]
            return tf.zeros(shape, s.dtype)

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(tf.nest.map_structure(zeros, spec))
        y_pred = self._model(x, training=False)
        if not self.built:
            self(x, training=False)
        if with_metrics and self._model.compiled:
            if y is not None:
                self._model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
            self._model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            self._model.reset_metrics()
            if optimizer is not None and not optimizer.built:
                optimizer.build(self._model.trainable_variables)

    def _sync_replicas(self) -> None:
        if self._tnt_synced or _runtime.get_size() == 1:
            self._tnt_synced = True
            return
        variables = list(self._model.variables)
        _sync.verify_same_on_all_ranks(variables, "model")
        _sync.broadcast_from_master(variables)
        optimizer = self._model.optimizer
        if optimizer is not None and optimizer.built:
            _sync.verify_same_on_all_ranks(optimizer.variables, "optimizer state")
            _sync.broadcast_from_master(optimizer.variables)
        self._tnt_synced = True

    def _warn_small_batch_norm(self, global_batch: int | None) -> None:
        size = _runtime.get_size()
        if size == 1 or global_batch is None:
            return
        if not any(isinstance(layer, keras.layers.BatchNormalization) for layer in _all_layers(self._model)):
            return
        local = global_batch // size
        if local < _BATCH_NORM_MIN_LOCAL_BATCH:
            logger.warning(
                "BatchNormalization uses the statistics of each rank's micro-batch, which "
                "holds only %d samples here (global batch %d on %d ranks); below %d they are "
                "noisy. Use a larger global batch or fewer ranks.",
                local, global_batch, size, _BATCH_NORM_MIN_LOCAL_BATCH,
            )

    def _rank_callbacks(self, callbacks):
        return callbacks_for_rank(
            callbacks, tensorboard_on_all_ranks=self._tnt_settings.tensorboard_on_all_devices
        )

    def _verbose(self, verbose):
        return verbose if _runtime.is_master_rank() else 0

    # -- training loop entry points -----------------------------------------------------------
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, sample_weight=None,
            validation_batch_size=None, initial_epoch=0, *, tnt_micro_batch_size=None,
            tnt_validation_micro_batch_size=None, tnt_distribute_dataset=True,
            tnt_distribute_validation_dataset=True, **kwargs):
        """Keras' ``fit`` on every rank; ``x`` is split into per-rank micro-batches.

        ``x`` is a ``tf.data.Dataset`` batched with the global batch size (recommended),
        an unbatched one with ``tnt_micro_batch_size``, or arrays with ``batch_size``.
        Epoch ``initial_epoch`` (or the one a ``BackupAndRestore`` backup resumes at) sees
        the shuffle order it has in a run that started at epoch 0 (see docs/keras.md).
        """
        self._assert_compiled("fit")
        if validation_split:
            if isinstance(x, tf.data.Dataset):
                raise InputError("tnt.Model.fit: validation_split needs arrays; pass validation_data= for datasets.")
            (x, y, sample_weight), validation_data = _split_arrays((x, y, sample_weight), validation_split)
        train = rank_dataset(
            x, y, sample_weight, batch_size=batch_size, shuffle=shuffle, method="fit",
            sharding=self._sharding(tnt_distribute_dataset, tnt_micro_batch_size), with_sizes=True,
        )
        val = None
        if validation_data is not None:
            if isinstance(validation_data, tf.data.Dataset):
                vx, vy, vsw = validation_data, None, None
            else:
                vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
            val = rank_dataset(
                vx, vy, vsw, batch_size=None if isinstance(vx, tf.data.Dataset) else (validation_batch_size or batch_size),
                shuffle=False, method="fit(validation_data)",
                sharding=self._sharding(tnt_distribute_validation_dataset, tnt_validation_micro_batch_size),
            )
        if not kwargs.get("steps_per_epoch"):
            _check_same_length(train, "training", "fit")
        if val is not None and not kwargs.get("validation_steps"):
            _check_same_length(val, "validation", "fit")
        self._build_from(train, with_metrics=True)
        self._sync_replicas()
        if isinstance(x, tf.data.Dataset):
            self._warn_small_batch_norm(global_batch_size(x, self._sharding(True, tnt_micro_batch_size)))
        else:
            self._warn_small_batch_norm(batch_size or _DEFAULT_BATCH_SIZE)
        callbacks, backup = _backup.adapt(callbacks)
        if backup is not None:
            restored = backup.restore(self)
            if restored is not None:
                initial_epoch = restored
        if initial_epoch > 0:
            train = _at_epoch(train, x, initial_epoch, kwargs.get("steps_per_epoch"))
        with self._rank_callbacks(callbacks) as rank_callbacks:
            return super().fit(
                train, epochs=epochs, verbose=self._verbose(verbose),
                callbacks=rank_callbacks, validation_data=val,
                shuffle=False, initial_epoch=initial_epoch, **kwargs,
            )

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=False, *, tnt_micro_batch_size=None,
                 tnt_distribute_dataset=True, **kwargs):
        """Keras' ``evaluate`` over the union of all ranks' micro-batches (global metrics)."""
        if kwargs.get("_use_cached_eval_dataset"):  # validation inside fit: already split
            return super().evaluate(x, y, batch_size=batch_size, verbose=verbose,
                                    sample_weight=sample_weight, steps=steps, callbacks=callbacks,
                                    return_dict=return_dict, **kwargs)
        self._assert_compiled("evaluate")
        data = rank_dataset(
            x, y, sample_weight, batch_size=batch_size, shuffle=False, method="evaluate",
            sharding=self._sharding(tnt_distribute_dataset, tnt_micro_batch_size),
        )
        if not steps:
            _check_same_length(data, "evaluation", "evaluate")
        self._build_from(data, with_metrics=True)
        self._sync_replicas()
        with self._rank_callbacks(callbacks) as rank_callbacks:
            return super().evaluate(
                data, verbose=self._verbose(verbose), steps=steps,
                callbacks=rank_callbacks, return_dict=return_dict, **kwargs,
            )

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None, *,
                tnt_micro_batch_size=None, tnt_distribute_dataset=True):
        """Keras' ``predict``; every rank returns the full predictions in input order."""
        data = rank_dataset(
            x, batch_size=batch_size, shuffle=False, method="predict",
            sharding=self._sharding(tnt_distribute_dataset, tnt_micro_batch_size),
        )
        if not tnt_distribute_dataset and _runtime.get_size() > 1:
            raise InputError(
                "tnt.Model.predict with tnt_distribute_dataset=False would gather every "
                "rank's own predictions into one array; call self.model.predict(...) for "
                "rank-local predictions instead."
            )
        self._build_from(data, with_metrics=False)
        self._sync_replicas()
        with self._rank_callbacks(callbacks) as rank_callbacks:
            return super().predict(data, verbose=self._verbose(verbose), steps=steps,
                                   callbacks=rank_callbacks)

    # -- files ---------------------------------------------------------------------------------
    def save(self, filepath, overwrite=True, *, tnt_save_all_devices=False, **kwargs) -> None:
        """Save the wrapped model (a plain Keras file) from the master rank, atomically."""
        _io.save_on_master(
            filepath, lambda tmp: self._model.save(tmp, overwrite=True, **kwargs),
            all_devices=tnt_save_all_devices,
        )

    def save_weights(self, filepath, overwrite=True, *, tnt_save_all_devices=False, **kwargs) -> None:
        """Save the weights from the master rank, atomically (``.weights.h5``)."""
        _io.save_on_master(
            filepath, lambda tmp: self._model.save_weights(tmp, overwrite=True, **kwargs),
            all_devices=tnt_save_all_devices,
        )

    def load_weights(self, filepath, *args, **kwargs) -> None:
        """Load weights read by the master rank; all replicas end up identical."""
        with _io.master_file(filepath) as local:
            self._model.load_weights(local, *args, **kwargs)
        self._tnt_synced = False
        self._sync_replicas()


#: Iterators Keras 3's EpochIterator creates per epoch when steps_per_epoch is None.
_KERAS_ITERATORS_PER_EPOCH = 2
#: Mixed with TensorFlow's global seed, so the common shuffle seed is not the user's seed.
_SEED_SALT = 0x746E74


def _global_seed() -> int | None:
    """TensorFlow's global seed (``tf.random.set_seed``), or None when none is set."""
    try:
        from tensorflow.python.eager import context
    except ImportError:  # pragma: no cover - TensorFlow moved it
        return None
    seed = context.global_seed()
    return None if seed is None else int(seed)


def _at_epoch(dataset: tf.data.Dataset, user_input, epoch: int, steps_per_epoch) -> tf.data.Dataset:
    """``dataset`` with its reshuffling state where a run from epoch 0 has it at ``epoch``.

    A shuffle with ``reshuffle_each_iteration`` draws a new order for each new iterator,
    and Keras' epoch loop creates ``_KERAS_ITERATORS_PER_EPOCH`` iterators per epoch of a
    dataset of known length (one when the epoch starts, one after its last batch).
    Creating (and dropping) as many iterators as the first ``epoch`` epochs would advances
    the order without reading data. This needs a dataset whose state starts fresh: tnt
    builds one per fit (distributed or from arrays); one passed through unchanged (one
    rank) is rebuilt. tests/test_resume.py checks the count against an uninterrupted run.
    """
    if steps_per_epoch:
        logger.warning(
            "fit(initial_epoch=%d) with steps_per_epoch: the data position of the interrupted "
            "run is not restored (Keras then continues one iterator across epochs); the "
            "resumed epochs start from a fresh iterator.", epoch)
        return dataset
    if dataset is user_input:
        try:
            dataset = tnt_data.distribute(dataset, rank=0, size=1)
        except tnt_data.DistributionError:
            logger.warning(
                "fit(initial_epoch=%d): this dataset cannot be rebuilt, so its shuffle order "
                "from epoch %d on may differ from an uninterrupted run.", epoch, epoch)
            return dataset
    if int(dataset.cardinality()) < 0:
        logger.warning(
            "fit(initial_epoch=%d): the dataset's length is unknown, so its shuffle order "
            "from epoch %d on may differ from an uninterrupted run.", epoch, epoch)
        return dataset
    for _ in range(epoch * _KERAS_ITERATORS_PER_EPOCH):
        iter(dataset)
    return dataset


def _check_same_length(dataset: tf.data.Dataset, what: str, method: str) -> None:
    """Every rank must run as many steps as the others, or one waits in a step forever.

    tnt's own split guarantees it; datasets the ranks build themselves
    (``tnt_distribute_dataset=False``) may differ. One small allgather per call. A length
    TensorFlow cannot tell (e.g. after ``filter``) is not checked here; a difference then
    shows as a stall after TNT_COMM_TIMEOUT.
    """
    if _runtime.get_size() == 1:
        return
    lengths = tnt_comm.allgather_object(int(dataset.cardinality()))
    if len(set(lengths)) == 1 or tf.data.UNKNOWN_CARDINALITY in lengths:
        return

    def show(n: int) -> str:
        return "infinite" if n == tf.data.INFINITE_CARDINALITY else str(n)

    per_rank = ", ".join(f"rank {r}: {show(n)}" for r, n in enumerate(lengths))
    raise InputError(
        f"tnt.Model.{method}: the ranks' {what} datasets have different numbers of batches "
        f"({per_rank}), so some rank would wait in a step the others never run. With "
        "tnt_distribute_dataset=False every rank must pass the same number of batches (e.g. "
        "dataset.shard(num_shards, index) of a dataset whose length the number of ranks "
        "divides, or .take(n) with the same n everywhere); or pass one dataset and let tnt "
        "split it (tnt_distribute_dataset=True)."
    )


def _split_arrays(arrays, validation_split: float):
    """Keras' rule: the last ``validation_split`` fraction of the samples validates."""
    if not 0 < validation_split < 1:
        raise InputError(f"validation_split must be in (0, 1), got {validation_split}.")
    first = next(a for a in tf.nest.flatten(arrays) if a is not None)
    n = int(first.shape[0])
    cut = int(n * (1.0 - validation_split))

    def take(a, sl):
        return None if a is None else tf.nest.map_structure(lambda t: t[sl], a)

    train = tuple(take(a, slice(0, cut)) for a in arrays)
    val = tuple(take(a, slice(cut, n)) for a in arrays)
    return train, val


def _all_layers(layer) -> list:
    """Every layer nested in ``layer`` (Keras' ``layers`` lists only the top level)."""
    out = []
    for sub in getattr(layer, "layers", []):
        out.append(sub)
        out.extend(_all_layers(sub))
    return out
