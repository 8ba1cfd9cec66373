"""``tnt.Model``: a Keras model that trains data-parallel on every rank of the job.

The wrapper is itself a ``keras.Model`` so that Keras' own fit/evaluate/predict loops,
callbacks and progress bars drive it unchanged; it owns no layers of its own. The
wrapped model keeps everything a user saves or inspects — layers, weights, optimizer,
compiled loss and metrics — so files written by ``tnt.Model.save`` are plain Keras files.
What the wrapper changes is where data comes from (this rank's micro-batches, see
``_inputs``), how a step ends (fused allreduce of gradients and metric states, see
``_steps``; a user's own steps in ``_custom_steps``), who writes files (the master rank,
atomically) and that all replicas start from rank 0's state (``_sync``). Optimizer
updates made outside tnt's steps (custom loops) are made global by ``_grad_sync``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import tensorflow as tf

from .. import native as _native
from .._core import backup as _backup
from .._core import batch_norm as _batch_norm
from .._core import deferred as _deferred
from .._core import files as _io
from .._core import inputs as _inputs
from .._core import internals as _internals
from .._core import memory as _memory
from .._core import runtime as _runtime
from .._core import settings as _settings
from .._core import sync as _sync
from .._core.distributed import DistributedModel
from .._core.inputs import DEFAULT_BATCH_SIZE as _DEFAULT_BATCH_SIZE
from .._core.inputs import InputError, Sharding, global_batch_size, rank_dataset
from .._core.log import logger
from .._core.step_parts import overrides
from .._core.strategy import (
    ParallelStrategy,
    Strategy,
    register,
    split_options,
    unknown_options_error,
)
from . import _grad_sync, _sharded_files, _sharding
from ._layer_shards import LayerShards
from ._level3_memory import level3_layout
from ._per_step import GatheredStepFunctions, PerStepShards
from ._steps import DistributedSteps

_BATCH_NORM_MIN_LOCAL_BATCH = 16
#: keras.Model keyword arguments the wrapper accepts (and ignores: it owns no layers).
_KERAS_MODEL_KWARGS = frozenset({"name", "trainable", "dtype"})


class Model(GatheredStepFunctions, DistributedModel):
    """Wrap ``model`` so that compile/fit/evaluate/predict run on all ranks of the job.

    Args:
        model: a built or unbuilt Keras 3 model (Sequential, functional or subclassed,
            with or without its own ``train_step``/``test_step``/``predict_step``).
        parallel_strategy: ``tnt.ParallelStrategy.DATA`` (default); ``PIPELINING`` or
            ``ALL`` (with ``num_pipeline_stages``, see docs/pipelining.md) and ``TENSOR``
            (with ``tensor_parallel_size``, see docs/tensor_parallel.md) return the
            pipelined or tensor-parallel model instead.
        sync_batch_norm: make every ``BatchNormalization`` layer normalise with the
            statistics of the global batch (as ``tnt.keras.layers.SyncBatchNormalization``
            does), so a model with batch normalisation trains as serial Keras does.
        sharding: 0 (default, or ``TNT_SHARDING``): every replica holds the whole optimizer
            state; 1: each replica keeps the optimizer state of the variables it owns;
            2: and receives only their summed gradients; 3: and stores only the weights it
            owns, gathered layer by layer around each call (a model with its own
            ``train_step``: gathered per step; docs/sharding.md). ``ALL`` takes every level
            too: shards within each stage's (or tensor shard's) replica group; level 3 there
            gathers per step (not with pipeline stages of tensor groups).
        memory_budget: bytes per rank (``"6GiB"``, ``"512MiB"``, an int; default none, or
            ``TNT_MEMORY_BUDGET``), taken by every strategy: ``fit`` first checks the plan's
            per-rank estimate against it and raises ``tnt.MemoryBudgetError`` on every rank
            when some rank exceeds it (docs/memory.md).
    """

    def __new__(cls, *args, **kwargs):
        # The strategy registry (``_core.strategy``) builds PIPELINING / TENSOR / ALL models;
        # None from it means the data-parallel wrapper (one rank, one stage, nothing split).
        model = args[0] if args else kwargs.get("model")
        default = ParallelStrategy.AUTO if kwargs.get("plan") is not None else ParallelStrategy.DATA
        parallel_strategy = args[1] if len(args) > 1 else kwargs.get("parallel_strategy", default)
        budget = _memory.budget_from(kwargs.get("memory_budget"))  # every layout takes it
        member, strategy, options, rest = split_options(
            parallel_strategy, {k: v for k, v in kwargs.items()
                                if k not in ("model", "parallel_strategy", "memory_budget")},
            where="tnt.Model")
        if member is not ParallelStrategy.DATA:
            unknown = sorted(set(rest) - _KERAS_MODEL_KWARGS)
            if unknown:
                raise unknown_options_error(strategy, member, unknown, where="tnt.Model",
                                            also=" (and Keras' name=/trainable=/dtype=)")
            _check_is_keras_model(model)
            if member is ParallelStrategy.AUTO:  # plans within the budget every layout checks
                options["memory_budget"] = kwargs.get("memory_budget")
            built = strategy.build(model, member, options)
            if built is not None:
                built._tnt_memory_budget = budget
                return built
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, model: keras.Model, parallel_strategy=ParallelStrategy.DATA, *,
                 sync_batch_norm: bool = False, sharding: int | None = None, memory_budget=None, **kwargs):
        if self.__dict__.get("_tnt_auto_built"):  # made by ParallelStrategy.AUTO (__new__)
            return
        _check_is_keras_model(model)
        self_sharding = _make_sharding(model, sharding)
        _materialise(model, self_sharding)
        # PIPELINING / TENSOR / ALL with nothing to distribute but data: their options were
        # checked by the strategy (__new__) and do not apply to the wrapper.
        kwargs = split_options(parallel_strategy, kwargs, where="tnt.Model")[3]
        unknown = sorted(set(kwargs) - _KERAS_MODEL_KWARGS)
        if unknown:
            raise TypeError(
                f"tnt.Model() got unknown keyword argument(s): {', '.join(unknown)}. It takes "
                "the Keras model, parallel_strategy=, and Keras' name=/trainable=/dtype=; "
                "options of fit/evaluate/predict (tnt_micro_batch_size=, ...) go to those calls, "
                "settings such as the fusion threshold to TNT_* environment variables."
            )
        kwargs.setdefault("name", f"tnt_{model.name}")
        super().__init__(**kwargs)
        self._tnt_settings = _runtime.setup()
        self._tnt_memory_budget = _memory.budget_from(memory_budget)
        self._model = model
        self._tnt_sharding = self_sharding
        if sync_batch_norm and _batch_norm.synchronise(model) == 0 and not _batch_norm.has_sync_batch_norm(model):
            logger.warning("tnt.Model(sync_batch_norm=True): the model has no BatchNormalization layer.")
        self._tnt_steps = DistributedSteps(
            model, _runtime.get_size(), self._tnt_settings.fusion_threshold_bytes, sharding=self_sharding
        )
        self._tnt_synced = False  # model and optimizer state made identical (fit/evaluate/...)
        self._tnt_weights_synced = False  # model weights broadcast at least once
        self._tnt_seed: int | None = None
        if _runtime.get_size() > 1:
            _grad_sync.register(model, self)
        if model.built:
            self.built = True
            self._sync_replicas()  # a custom training loop may start right away
        if model.compiled:  # e.g. loaded from a .keras file with its training config
            self._compile_wrapper()

    # -- what the wrapped model is -------------------------------------------------
    @property
    def model(self) -> keras.Model:
        """The wrapped Keras model (serial view: same weights on every rank)."""
        return self._model

    def call(self, inputs, training=None, mask=None):
        """The wrapped model's forward pass; the first eager call also syncs the replicas."""
        outputs = self._model(inputs, training=training)
        if not self._tnt_weights_synced and tf.executing_eagerly():
            # Built by this first call (a custom training loop): start replicas alike.
            if _runtime.get_size() > 1:
                _sync.sync_replicas(self._model)
            self._tnt_weights_synced = True
        return outputs

    @property
    def layers(self):
        """The wrapped model's layers."""
        return self._model.layers

    @property
    def metrics(self):
        """The wrapped model's metrics (their states hold global totals after a step)."""
        return self._model.metrics

    @property
    def metrics_names(self):
        """Names of the wrapped model's metrics."""
        return self._model.metrics_names

    def get_config(self) -> dict[str, Any]:
        return self._model.get_config()

    def to_json(self, **kwargs) -> str:
        return self._model.to_json(**kwargs)

    # get_weights / set_weights: the base's (serial-shaped; the master's values win).
    def _tnt_serial_weights(self):
        """Every replica holds the serial model: its own weights, no collective."""
        with self._whole():
            return self._model.get_weights()

    def _tnt_serial_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(w.shape) for w in self._model.weights]

    def _tnt_assign_serial(self, weights) -> None:
        """Every replica takes the whole list (the master's, broadcast by the base)."""
        with self._whole(gather=False):
            self._model.set_weights(weights)

    def __getattr__(self, name: str):
        # Attributes defined by a subclassed model (e.g. `model.encoder`) stay reachable.
        if name.startswith("_"):
            raise AttributeError(name)
        inner = self.__dict__.get("_model")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    # -- compile ----------------------------------------------------------------------
    def compile(self, *args, **kwargs) -> None:
        """Compile the wrapped model with exactly these arguments; the wrapper's steps
        then use its loss, metrics and optimizer(s).

        A model with its own ``compile`` (a GAN taking two optimizers) gets its own
        arguments. ``jit_compile`` is honoured: on one rank as Keras does; on several
        ranks XLA compiles the part of each default step before the gradient exchange and
        the part after it (the exchange itself runs outside the compiler).
        """
        self._model.compile(*args, **kwargs)
        self._compile_wrapper()

    def _compile_wrapper(self) -> None:
        """Let Keras' loops run on the wrapper, with the wrapped model's optimizer.

        On several ranks the wrapper's step function itself is not XLA-compiled (it holds
        the exchange); DistributedSteps compiles the halves around it instead.
        """
        inner = self._model
        if self._tnt_sharding is not None:  # slots of the owned variables only
            if inner.optimizer is not None and inner.optimizer.built and inner.trainable_variables:
                _sharded_files.reshard(inner, self._tnt_sharding)  # a file's serial state
            self._tnt_sharding.install(inner.optimizer)
        jit = False if _runtime.get_size() > 1 else inner.jit_compile
        super().compile(
            optimizer=inner.optimizer, loss=None, run_eagerly=inner.run_eagerly,
            steps_per_execution=inner.steps_per_execution, jit_compile=jit,
        )
        self._tnt_steps.close()
        self._tnt_steps = DistributedSteps(
            inner, _runtime.get_size(), self._tnt_settings.fusion_threshold_bytes,
            sharding=self._tnt_sharding,
        )
        self._tnt_synced = False

    @property
    def optimizer(self):
        """The wrapped model's optimizer once compiled, else None."""
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

    def _ensure_compiled_for_inference(self) -> None:
        """predict() needs no optimizer or loss: compile the wrapper alone if needed."""
        if not self.compiled:
            jit = False if _runtime.get_size() > 1 else "auto"
            keras.Model.compile(self, optimizer=None, loss=None, jit_compile=jit)

    # -- steps (called by Keras' loops) --------------------------------------------------
    def train_step(self, data):
        """One data-parallel step: local gradients, summed across ranks, then applied."""
        return self._tnt_steps.train_step(data)

    def test_step(self, data):
        """One evaluation step on this rank's micro-batch; metric states summed across ranks."""
        return self._tnt_steps.test_step(data)

    def predict_step(self, data):
        """One prediction step on this rank's micro-batch."""
        return self._tnt_steps.predict_step(data)

    # -- preparing a run -------------------------------------------------------------------
    def _sharding(self, distribute: bool, micro_batch_size: int | None) -> Sharding:
        return Sharding(
            rank=_runtime.get_rank(), size=_runtime.get_size(), distribute=distribute,
            micro_batch_size=micro_batch_size, shuffle_seed=self._common_seed(),
        )

    def _prepare(self, dataset: tf.data.Dataset, with_metrics: bool) -> None:
        """Before any step of fit/evaluate/predict/*_on_batch: variables exist everywhere,
        replicas are identical."""
        shards = self._layer_shards()
        # Level 3: a forward pass that builds the metrics gathers each layer's weights (or,
        # gathered per step, the whole weights).
        with shards.step(backward=False) if shards is not None and shards.released() else self._per_call():
            _sync.build_variables(self._model, self, dataset, with_metrics)
        self._sync_replicas()

    def _sync_replicas(self) -> None:
        per_step = self._per_step()
        if not self._tnt_synced and _runtime.get_size() > 1 and per_step is not None:
            # Whole first (a collective, after a load or a recompile), then from here on each
            # replica stores what it owns; the optimizer state is each replica's own.
            per_step.gather()
            _sync.sync_replicas(self._model, with_optimizer=False)
            per_step.owners = list(self._tnt_sharding.owners)
            per_step.release(self._model.trainable_variables)
        elif not self._tnt_synced and _runtime.get_size() > 1:
            shards = self._layer_shards()
            if shards is not None and shards.released():  # each owner holds the only copy
                _sync.sync_replicas(self._model, with_optimizer=False, skip=shards.is_per_layer)
            else:
                _sync.sync_replicas(self._model, with_optimizer=self._tnt_sharding is None)
                if shards is not None:  # level 3: from now on a replica stores what it owns
                    shards.release()
        self._tnt_synced = self._tnt_weights_synced = True

    def _layer_shards(self):
        """Level 3's per-layer shards (``_layer_shards.LayerShards``), else None."""
        return None if self._tnt_sharding is None else self._tnt_sharding.layers

    def _per_step(self):
        """Level 3 of a model's own train_step (``_per_step.PerStepShards``), else None."""
        return None if self._tnt_sharding is None else self._tnt_sharding.per_step

    def _whole(self, gather: bool = True):
        """While inside, every replica holds every weight (level 3 gathers them: a collective)."""
        shards = self._layer_shards()
        if shards is not None:
            return shards.whole(gather)
        return self._per_call(gather)

    def _per_call(self, gather: bool = True):
        """Level 3 gathered per step: while inside, the whole weights (gathered on entry, a
        collective; ``gather`` False: zeros, for a load to overwrite), freed again on exit.
        Nests: Keras' step functions inside one call of evaluate/predict gather nothing more."""
        per_step = self._per_step()
        if per_step is None:
            return contextlib.nullcontext()
        return per_step.gathered(self._model.trainable_variables, gather)

    def _average_moving_statistics(self) -> None:
        if _runtime.get_size() > 1:
            _sync.average_moving_statistics(self._model)

    def _warn_small_batch_norm(self, global_batch: int | None) -> None:
        size = _runtime.get_size()
        if size == 1 or global_batch is None or not _batch_norm.has_local_batch_norm(self._model):
            return  # sync_batch_norm=True: every layer normalises over the global batch
        local = global_batch // size
        if local < _BATCH_NORM_MIN_LOCAL_BATCH:
            logger.warning(
                "BatchNormalization uses the statistics of each rank's micro-batch, which "
                "holds only %d samples here (global batch %d on %d ranks); below %d they are "
                "noisy. Use a larger global batch or fewer ranks.",
                local, global_batch, size, _BATCH_NORM_MIN_LOCAL_BATCH,
            )

    # -- training loop entry points -----------------------------------------------------------
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
            validation_batch_size=None, validation_freq=1, *,
            tnt_micro_batch_size=None, tnt_validation_micro_batch_size=None,
            tnt_distribute_dataset=True, tnt_distribute_validation_dataset=True):
        """Keras' ``fit`` on every rank; ``x`` is split into per-rank micro-batches.

        ``x`` is a ``tf.data.Dataset`` batched with the global batch size (recommended),
        an unbatched one with ``tnt_micro_batch_size``, or arrays with ``batch_size``
        (shuffled as plain Keras shuffles them under the same seed).
        Epoch ``initial_epoch`` (or the one a ``BackupAndRestore`` backup resumes at) sees
        the shuffle order it has in a run that started at epoch 0 (see docs/keras.md).
        """
        self._assert_compiled("fit")
        self._tnt_memory_before_fit(x, batch_size)
        if validation_split:
            if isinstance(x, tf.data.Dataset):
                raise InputError("tnt.Model.fit: validation_split needs arrays; pass validation_data= for datasets.")
            (x, y, sample_weight), validation_data = _inputs.split_arrays((x, y, sample_weight), validation_split)
        train = rank_dataset(
            x, y, sample_weight, batch_size=batch_size, shuffle=shuffle, method="fit",
            sharding=self._sharding(tnt_distribute_dataset, tnt_micro_batch_size), with_sizes=True,
            class_weight=class_weight,
        )
        val = None
        if validation_data is not None:
            vx, vy, vsw, vbatch = _inputs.unpack_validation(validation_data, validation_batch_size, batch_size)
            val = rank_dataset(
                vx, vy, vsw, batch_size=vbatch, shuffle=False, method="fit(validation_data)",
                sharding=self._sharding(tnt_distribute_validation_dataset, tnt_validation_micro_batch_size),
            )
        if not steps_per_epoch:
            _inputs.check_same_length(train, "training", "fit")
        if val is not None and not validation_steps:
            _inputs.check_same_length(val, "validation", "fit")
        self._prepare(train, with_metrics=True)
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
            train = _inputs.at_epoch(train, x, initial_epoch, steps_per_epoch)
        with self._rank_callbacks(callbacks) as rank_callbacks:
            try:
                return super().fit(
                    train, epochs=epochs, verbose=self._verbose(verbose),
                    callbacks=rank_callbacks, validation_data=val,
                    shuffle=False, initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
                    validation_steps=validation_steps, validation_freq=validation_freq,
                )
            finally:
                self._average_moving_statistics()

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=False, *, tnt_micro_batch_size=None,
                 tnt_distribute_dataset=True, **kwargs):
        """Keras' ``evaluate`` over the union of all ranks' micro-batches (global metrics)."""
        if _internals.is_cached_eval_call(kwargs):  # validation inside fit: already split
            self._average_moving_statistics()
            with self._per_call():  # level 3 per step: gathered once for the whole call
                return super().evaluate(x, y, batch_size=batch_size, verbose=verbose,
                                        sample_weight=sample_weight, steps=steps, callbacks=callbacks,
                                        return_dict=return_dict, **kwargs)
        self._assert_evaluable()
        data = rank_dataset(
            x, y, sample_weight, batch_size=batch_size, shuffle=False, method="evaluate",
            sharding=self._sharding(tnt_distribute_dataset, tnt_micro_batch_size),
        )
        if not steps:
            _inputs.check_same_length(data, "evaluation", "evaluate")
        self._prepare(data, with_metrics=True)
        self._average_moving_statistics()
        with self._rank_callbacks(callbacks) as rank_callbacks, self._per_call():
            return super().evaluate(
                data, verbose=self._verbose(verbose), steps=steps,
                callbacks=rank_callbacks, return_dict=return_dict, **kwargs,
            )

    def _assert_evaluable(self) -> None:
        """evaluate() needs a loss (or metrics), not an optimizer."""
        if not self._model.compiled:
            self._assert_compiled("evaluate")
        if not self.compiled:
            self._compile_wrapper()

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None, *,
                tnt_micro_batch_size=None, tnt_distribute_dataset=True):
        """Keras' ``predict``; every rank returns the full predictions in input order.

        Works on an uncompiled model (e.g. loaded with ``compile=False``).
        """
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
        self._ensure_compiled_for_inference()
        self._prepare(data, with_metrics=False)
        with self._rank_callbacks(callbacks) as rank_callbacks, self._per_call():
            return super().predict(data, verbose=self._verbose(verbose), steps=steps,
                                   callbacks=rank_callbacks)

    # -- one batch at a time ---------------------------------------------------------------
    def _one_batch(self, x, y, sample_weight, method: str, with_sizes: bool, class_weight=None):
        """This rank's share of one global batch given as arrays, and its dataset."""
        first = next(t for t in tf.nest.flatten(x) if t is not None)
        n = int(first.shape[0])
        if n < 1:
            raise InputError(f"tnt.Model.{method}: the batch is empty.")
        data = rank_dataset(
            x, y, sample_weight, batch_size=n, shuffle=False, method=method,
            sharding=self._sharding(True, None), with_sizes=with_sizes, class_weight=class_weight,
        )
        return next(iter(data)), data

    def _run_one(self, function, element, return_dict: bool):
        def one():
            yield element

        logs = function(one())
        logs = {k: float(v) if tf.is_tensor(v) and v.shape.rank == 0 else v for k, v in logs.items()}
        return logs if return_dict else _internals.flatten_logs(self, logs)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """One training step on the global batch ``x`` (the same on every rank, as in a
        serial script); each rank computes its share, the update is the serial one."""
        self._assert_compiled("train_on_batch")
        element, data = self._one_batch(x, y, sample_weight, "train_on_batch", True, class_weight)
        self._prepare(data, with_metrics=True)
        self.make_train_function()
        self.reset_metrics()
        return self._run_one(self.train_function, element, return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        """Loss and metrics of the global batch ``x`` (given whole on every rank)."""
        self._assert_evaluable()
        element, data = self._one_batch(x, y, sample_weight, "test_on_batch", False)
        self._prepare(data, with_metrics=True)
        self._average_moving_statistics()
        self.make_test_function()
        self.reset_metrics()
        return self._run_one(self.test_function, element, return_dict)

    def predict_on_batch(self, x):
        """Predictions for the global batch ``x``, complete and in order on every rank."""
        self._ensure_compiled_for_inference()
        element, data = self._one_batch(x, None, None, "predict_on_batch", False)
        self._prepare(data, with_metrics=False)
        self.make_predict_function()
        outputs = self.predict_function([element])
        return tf.nest.map_structure(lambda t: t.numpy(), outputs)

    # -- files (the base writes them; see _core.distributed) ----------------------------------
    _tnt_whole_on_every_rank = True

    def _tnt_gather_serial(self, with_optimizer: bool = True) -> keras.Model | None:
        """The wrapped model itself: every rank holds the whole serial model."""
        return self._model

    def _tnt_before_save(self) -> None:
        self._average_moving_statistics()

    def _tnt_serial_state(self):
        """While inside, the master's wrapped model holds the whole optimizer state (a
        collective; BackupAndRestore writes under it)."""
        if self._tnt_sharding is None:
            return contextlib.nullcontext()
        if not self._model.compiled:
            return self._whole()
        return _together(self._whole(), _sharded_files.serial_optimizer(self._model, self._tnt_sharding, gather=True))

    def _write(self, filepath, overwrite: bool, all_devices: bool, with_optimizer: bool, write,
               kind: str | None = None) -> None:
        if self._tnt_sharding is None or not with_optimizer or not self._model.compiled:
            with self._whole():
                return super()._write(filepath, overwrite, all_devices, with_optimizer, write, kind)
        if all_devices:
            raise _sharding.ShardingError("tnt_save_all_devices=True is not supported with sharding >= 1 "
                                          "(only the master assembles the whole optimizer state).")
        with self._whole(), _sharded_files.serial_optimizer(self._model, self._tnt_sharding, gather=True):
            super()._write(filepath, overwrite, all_devices, with_optimizer, write, kind)
    def _tnt_memory_layout(self) -> _memory.Holdings:
        """A whole replica. The fused engine's buckets are a gradient set of their own only
        where they stay alive together: kept between rounds (TNT_COMM_TRANSIENT_BUCKETS=0)
        or waited for all at once (the fallback without native ops). Transient buckets waited
        one at a time replace the gradients they carry (docs/memory.md, "Buckets one at a time")."""
        n = _runtime.get_size()
        batch = getattr(self, "_tnt_memory_global_batch", None)
        one_at_a_time = _settings.transient_buckets() and _native.in_use()
        optimizer = self._model.optimizer if self._model.compiled else None
        counted: dict[str, int] = {}
        what = f"DATA, {n} replica(s)"
        if self._layer_shards() is not None:  # level 3: the owned part of most weights
            mine = level3_layout(self._model, n).replicas[self._tnt_sharding.rank]
            counted = {"parameters": mine.parameters, "gradients": mine.gradients,
                       "optimizer_slots": _memory.slot_bytes(optimizer, self._tnt_sharding.owned_variables()),
                       "communication_buffers": mine.gathered}
            what += ", sharding=3"
        return _memory.Holdings(
            model=self._model, optimizer=optimizer, what=what, rows=-(-batch // n) if batch else None,
            comm_gradient_sets=1 if n > 1 and not one_at_a_time and not counted else 0, counted=counted)

    def _tnt_summary(self, *args, **kwargs) -> None:
        self._model.summary(*args, **kwargs)

    def export(self, filepath, format="tf_saved_model", verbose=True, **kwargs) -> None:
        """Keras' ``export`` of the serial model (refused at sharding=3, on every rank)."""
        if self._layer_shards() is not None:
            raise _sharding.ShardingError(
                "tnt.Model.export() at sharding=3 is not supported: save() the model (one ordinary "
                "Keras file), load it serially with keras.models.load_model and export that.")
        with self._per_call():  # level 3 per step: the whole weights while Keras exports them
            super().export(filepath, format=format, verbose=verbose, **kwargs)

    def load_weights(self, filepath, *args, **kwargs) -> None:
        """Load weights read by the master rank; all replicas end up identical."""
        with _io.master_file(filepath) as local, self._whole(gather=False):
            if self._tnt_sharding is not None and self._model.compiled:
                _sharded_files.load_into(self._model, self._tnt_sharding,
                                         lambda: self._model.load_weights(local, *args, **kwargs))
            else:
                self._model.load_weights(local, *args, **kwargs)
        self._tnt_synced = False
        self._sync_replicas()


def _make_sharding(model: keras.Model, sharding) -> _sharding.Sharding | None:
    """The model's shards for ``sharding=`` (or ``TNT_SHARDING``); None at level 0 or on one rank."""
    level = _settings.sharding_level(sharding)
    if level == 0 or _runtime.get_size() == 1:
        return None
    # Its collectives move at most a fusion threshold's bytes at once (TNT_FUSION_THRESHOLD).
    shards = _sharding.Sharding(model, level, bucket_bytes=_settings.load().fusion_threshold_bytes)
    if level == 3 and overrides(model, "train_step"):  # its own tape and apply: whole weights per step
        shards.per_step = PerStepShards(shards.comm, shards.bucket_bytes)
    elif level == 3:  # parameters too: each layer's weights gathered around its call
        shards.layers = LayerShards(shards)
    return shards


def _materialise(model: keras.Model, shards: _sharding.Sharding | None) -> None:
    """A model built in ``tnt.deferred_variables()`` gets its values here: at level 3 each
    replica only those it stores (``LayerShards.materialise_owned``), else every replica the
    whole model (its initializers' values, the ones an eager build gives)."""
    if not _deferred.has_deferred(model):
        return
    if shards is not None and shards.layers is not None:
        shards.layers.materialise_owned()
    else:
        _deferred.materialise(model)


@contextlib.contextmanager
def _together(first, second):
    """Enter ``first``, then ``second`` (a context manager of both, for a return value)."""
    with first, second:
        yield


def _check_is_keras_model(model) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"tnt.Model wraps a keras.Model, got {type(model).__name__}. "
            "Build the Keras model first, then pass it: tnt.Model(keras_model)."
        )
    if isinstance(model, DistributedModel):
        raise TypeError("This model is already a tnt.Model; wrap the Keras model only once.")


register(Strategy(
    name="data", handles=(ParallelStrategy.DATA,), options=("sync_batch_norm", "sharding"), error=TypeError,
    build=lambda model, member, options: None,  # the wrapper itself (Model.__init__)
    load=lambda filepath, member, options, **kwargs: None,  # tnt.models.load_model's own path
))
