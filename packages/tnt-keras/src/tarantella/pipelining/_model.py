"""``tnt.Model(..., parallel_strategy=PIPELINING | ALL)``: the pipelined model of one rank.

Like the data-parallel wrapper, it is a ``keras.Model`` so that Keras' own fit/evaluate/
predict loops, callbacks, History and progress bars drive it. It holds no layer of the
user's model: only this rank's stage (``stage_model``), built from clones of the stage's
layers. Keras' loop runs eagerly on the wrapper; each step runs the stage's schedule,
whose forward and backward passes are compiled ``tf.function``s (``_executor``).

Every rank of a replica reads the same replica batch (``tnt_data.distribute`` over the
replicas): stage 0 (and any stage reading a model input) uses x, the last stage y and
the sample weights, all use its size to cut the micro-batches.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from .._core import backup as _backup
from .._core import memory as _memory
from .._core import runtime as _runtime
from .._core.compile_args import own_compile_arguments
from .._core.distributed import DistributedModel
from .._core.errors import PipelineError
from .._core.inputs import Sharding, at_epoch, fit_datasets, rank_dataset
from .._core.mesh import check_layout
from .._core.serial_files import assign_optimizer_state, optimizer_state
from .._core.step_parts import split_sizes
from ._interleaved import check_interleaved_options, check_interleaved_strategy, chunk_plan
from ._plan import Plan
from ._remat import check_remat
from ._saving import (
    fill_serial_model,
    gather_serial_model,
    load_pipelined_weights,
    serial_model_from_config,
    serial_weight_keys,
    stage_payload,
    streamed_save,
)
from ._schedule import INTERLEAVED, activation_bound, check_schedule, schedule_grid
from ._stage_runtime import StageRuntime
from ._stages import held_layers
from ._transport import CommTransport


def default_micro_batches(num_stages: int) -> int:
    """4p micro-batches: bubble (p - 1) / (5p - 1), under 20 % of a step."""
    return 4 * num_stages


def check_micro_batches(m) -> int:
    if not isinstance(m, int | np.integer) or isinstance(m, bool) or m < 1:
        raise PipelineError(f"num_micro_batches must be an integer >= 1, got {m!r}.")
    return int(m)


def _live(value):
    """A compile argument as ``compile`` takes it: a loaded file holds serialised configs."""
    try:
        return keras.saving.deserialize_keras_object(value)
    except (TypeError, ValueError):
        return value


def _split_sizes(data):
    return split_sizes(data)


class PipelinedModel(DistributedModel):
    """This rank's stage of a model pipelined over ``num_pipeline_stages`` ranks (per replica)."""

    def __init__(self, model: keras.Model, *, parallel_strategy: str = "pipelining",
                 num_pipeline_stages: int | None = None, num_micro_batches: int | None = None,
                 pipeline_schedule: str = "1f1b", pipeline_plan: Plan | None = None,
                 remat: str | None = None, virtual_stages: int | None = None, sharding: int = 0,
                 _stage_builder=None) -> None:
        """``sharding`` (ALL's replica axis, 1, 2 or 3): see ``_shards``; at 3 the files, weights
        and forward-only loops hold the stage's whole weights while they run (``_tnt_whole``).
        ``_stage_builder(plan, transport) -> StageModel``: how this rank's stage is made
        (default: the stage's layers cloned whole; tensor_parallel's stages of tensor groups
        pass their own, with ``tensor_parallel_size``: the mesh then has t > 1)."""
        super().__init__(name=f"tnt_{model.name}")
        self._tnt_settings = _runtime.setup()
        check_schedule(pipeline_schedule)
        t = getattr(_stage_builder, "tensor_parallel_size", 1)
        strategy = "pipelining" if t == 1 and str(getattr(parallel_strategy, "value", parallel_strategy)) == \
            "pipelining" else "all"
        check_interleaved_strategy(pipeline_schedule, strategy, virtual_stages)
        if pipeline_plan is not None and pipeline_schedule not in INTERLEAVED:
            if num_pipeline_stages is not None and num_pipeline_stages != pipeline_plan.num_stages:
                raise PipelineError(f"pipeline_plan has {pipeline_plan.num_stages} stages but "
                                    f"num_pipeline_stages={num_pipeline_stages}; make them agree.")
        plan, p, v = chunk_plan(model, pipeline_schedule, num_pipeline_stages, virtual_stages, pipeline_plan)
        m = default_micro_batches(p) if num_micro_batches is None else check_micro_batches(num_micro_batches)
        check_interleaved_options(pipeline_schedule, strategy, p, m)
        mesh = check_layout(parallel_strategy, _runtime.get_size(), t, p)
        self.remat = check_remat(remat)
        self.plan = plan
        self.num_pipeline_stages = p
        self.virtual_stages = v
        self.parallel_strategy = parallel_strategy
        self.num_micro_batches = m
        self.pipeline_schedule = pipeline_schedule
        self.mesh = mesh
        transport = CommTransport(mesh)
        stage_model = _stage_builder(plan, transport) if _stage_builder else None
        self._tnt_check_same_plan(transport)
        self._tnt_stage = StageRuntime(plan, transport, pipeline_schedule, m, stage_model=stage_model,
                                       fusion_threshold_bytes=self._tnt_settings.fusion_threshold_bytes,
                                       remat=self.remat, virtual_stages=v, sharding=sharding)
        self._tnt_serial_config = (type(model), model.get_config())
        self._tnt_mixed_float16 = model.dtype_policy.name == "mixed_float16"
        self._tnt_compile_args: dict | None = None
        self._tnt_synced = False
        self._tnt_seed: int | None = None
        self._tnt_serial_keys: list | None = None
        self.built = True
        # The schedule is driven from Python (numpy boundaries between stages): Keras' loops
        # must call the steps eagerly, also before compile (predict of an uncompiled model).
        self.run_eagerly = True
        if model.compiled:  # e.g. loaded from a .keras file with its training configuration
            self._compile_from(model)

    # -- what this rank holds ----------------------------------------------------------------
    @property
    def stage_model(self) -> keras.Model:
        """This rank's stage as a Keras model (its layers only)."""
        return self._tnt_stage.model

    @property
    def stage(self) -> int:
        """This rank's stage index."""
        return self._tnt_stage.transport.stage

    @property
    def replica(self) -> int:
        """This rank's pipeline replica (0 with PIPELINING)."""
        return self._tnt_stage.transport.replica

    @property
    def num_replicas(self) -> int:
        """How many pipelines train data-parallel (N / p)."""
        return self._tnt_stage.transport.num_replicas

    @property
    def transport(self):
        """How this rank's stage talks to its pipeline and its replicas (``CommTransport``)."""
        return self._tnt_stage.transport

    @property
    def loss_scaled(self) -> bool:
        """Whether the stage's optimizer is a ``LossScaleOptimizer`` (decided over all stages)."""
        return self._tnt_stage.loss_scaled

    def schedule_grid(self) -> str:
        """This model's schedule as a stage x time-slot grid with its bubble fraction
        (``tnt.pipelining.schedule_grid``)."""
        return schedule_grid(self.pipeline_schedule, self.num_pipeline_stages, self.num_micro_batches,
                             virtual_stages=self.virtual_stages if self.virtual_stages > 1 else None)

    @property
    def peak_micro_batches_in_flight(self) -> int:
        """The most micro-batches whose activations this stage held at once."""
        return self._tnt_stage.peak_live

    def pipeline_stats(self, reset: bool = False) -> dict:
        """This rank's schedule time, compute time and idle fraction over the train steps so far.

        ``idle_fraction`` is 1 - compute / schedule time of this stage alone. ``windows``
        holds (start, end, compute seconds) of the last 10000 train schedules, start and
        end from ``time.time()``: gathered from all stages they give the idle fraction
        over the pipeline's whole span of each step (:func:`pipeline_idle_fractions`).
        """
        st = self._tnt_stage
        stats = {"stage": self.stage, "replica": self.replica, "schedule_seconds": st.schedule_seconds,
                 "busy_seconds": st.busy_seconds,
                 "idle_fraction": 1.0 - st.busy_seconds / st.schedule_seconds if st.schedule_seconds else None,
                 "peak_micro_batches_in_flight": st.peak_live, "windows": list(st.windows)}
        if reset:
            st.schedule_seconds = st.busy_seconds = 0.0
            st.windows.clear()
        return stats

    @property
    def metrics(self):
        """No Keras metric objects: logs come from the last stage, global and identical on
        every rank."""
        return []

    # -- serial-shaped weights (the base's get_weights / set_weights) -------------------------
    def _tnt_stage_payload(self, with_optimizer: bool) -> dict:
        """This stage's serial-shaped weights by layer (and optimizer state by key)."""
        return stage_payload(self, with_optimizer)

    def _tnt_serial_weights(self) -> list[np.ndarray]:
        """Every stage's weights joined in the serial order, on every rank (collective:
        an allgather over the pipeline; the replicas hold the same)."""
        by_layer = {}
        with self._tnt_whole():
            payloads = self.transport.pipeline_allgather_object(self._tnt_stage_payload(False))
        for payload in payloads:
            by_layer.update(payload["weights"])
        return [w for name in self.plan.graph.layer_order for w in by_layer.get(name, [])]

    def _tnt_serial_layout(self) -> list[tuple[str, tuple[int, ...]]]:
        if getattr(self, "_tnt_serial_keys", None) is None:
            self._tnt_serial_keys = serial_weight_keys(self)
        return self._tnt_serial_keys

    def _tnt_serial_shapes(self) -> list[tuple[int, ...]]:
        return [shape for _, shape in self._tnt_serial_layout()]

    def _tnt_part(self, layer, variable, value: np.ndarray) -> np.ndarray:
        """What ``variable`` of the stage's ``layer`` holds of the serial ``value``: all of it."""
        return value

    def stage_layers(self) -> list:
        """This rank's stage's layers, those whose outputs reach no output included (held
        whole, trained with zero gradient, saved)."""
        return held_layers(self.stage_model)

    def _tnt_assign_serial(self, weights) -> None:
        """This stage's layers take their weights from the serial list (matched by layer
        name and weight index); other stages' weights are ignored."""
        by_key = {key: w for (key, _), w in zip(self._tnt_serial_layout(), weights)}
        with self._tnt_whole(gather=False):
            for layer in self.stage_layers():
                for j, variable in enumerate(layer.weights):
                    variable.assign(self._tnt_part(layer, variable, by_key[f"{layer.name}/{j}"]))
        self._tnt_synced = False

    def _tnt_whole(self, gather: bool = True):
        """While inside, every replica holds its stage's whole weights (sharding=3: gathered
        from their owners, a collective over the replica group, and freed again after;
        ``gather`` False: zeros, for a load to overwrite)."""
        return self._tnt_stage.gathered(values=gather)

    def _tnt_serial_state(self):
        """What BackupAndRestore writes under: the stage's whole weights (sharding=3)."""
        return self._tnt_whole()

    def _tnt_check_same_plan(self, transport) -> None:
        """Every stage's plan equals stage 0's, or every stage raises (a stage raising alone
        would leave the others waiting in their next collective)."""
        mine = (self.plan.split_after, [(b.tensor, b.shape, b.dtype, b.producer, b.consumers)
                                        for b in self.plan.boundaries])
        first = transport.pipeline_broadcast_object(mine, 0)
        differing = transport.pipeline_allreduce(np.array([float(first != mine)]))
        if differing[0]:
            mismatch = f"this stage's plan {mine} vs stage 0's {first}" if first != mine else \
                f"{int(differing[0])} stage(s) differ from stage 0's plan {first}"
            raise PipelineError(
                f"the pipeline stages computed different plans ({mismatch}; seen on stage "
                f"{transport.stage}). Every rank must build the same model with the same layer "
                "names: Keras numbers auto-named layers and models per process, so a rank that "
                "built another Keras model first (e.g. a serial reference on the master only) "
                "names them differently. Build the model to wrap first on every rank, or give "
                "its layers and nested models explicit names.")

    # -- compile -------------------------------------------------------------------------------
    def _tnt_own_compile_arguments(self, args: tuple, kwargs: dict) -> dict:
        """``keras.Model.compile``'s arguments as the user's model's own ``compile`` passes
        them on (a model with shapes only is built for a class that has one)."""
        return own_compile_arguments(self._tnt_serial_config[0],
                                     lambda: serial_model_from_config(self, deferred=True), args, kwargs)

    def compile(self, *args, **kwargs) -> None:
        """Each stage gets a clone of the optimizer; the last stage the loss and metrics —
        those the user's model's own ``compile`` passes on (its defaults: keras-hub's metrics).

        Like Keras' ``compile``, a ``mixed_float16`` model (its policy when it was built)
        gets the optimizer wrapped in a ``LossScaleOptimizer`` unless ``auto_scale_loss``
        is False; its skip decision is taken over all stages (``StageRuntime``).
        """
        resolved = self._tnt_own_compile_arguments(args, kwargs)
        optimizer, loss, metrics, loss_weights, weighted_metrics, steps_per_execution, auto_scale_loss = (
            resolved[k] for k in ("optimizer", "loss", "metrics", "loss_weights", "weighted_metrics",
                                  "steps_per_execution", "auto_scale_loss"))
        optimizer = keras.optimizers.get(optimizer)
        if auto_scale_loss and self._tnt_mixed_float16 and \
                not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, name="loss_scale_optimizer")
        self._tnt_compile_args = dict(optimizer=optimizer, loss=loss,
                                      metrics=metrics, loss_weights=loss_weights,
                                      weighted_metrics=weighted_metrics)
        args = dict(self._tnt_compile_args)
        self._tnt_stage.compile(args.pop("optimizer"), **args)
        # Keras' loop runs the wrapper eagerly; the stage's passes are compiled functions.
        # It also groups steps_per_execution steps per callback call as for a serial model.
        super().compile(optimizer=self._tnt_stage.optimizer, loss=None, run_eagerly=True,
                        steps_per_execution=steps_per_execution, auto_scale_loss=False)
        self._tnt_synced = False

    def _compile_from(self, model: keras.Model) -> None:
        compile_config = getattr(model, "_compile_config", None)
        config = {k: _live(v) for k, v in compile_config.config.items()} if compile_config else {}
        self.compile(optimizer=model.optimizer, loss=config.get("loss", model.loss),
                     metrics=config.get("metrics"), loss_weights=config.get("loss_weights"),
                     weighted_metrics=config.get("weighted_metrics"))
        assign_optimizer_state(self._tnt_stage.optimizer, self.stage_model,
                               optimizer_state(model.optimizer, model))

    def _assert_compiled(self, method: str) -> None:
        if self._tnt_compile_args is None:
            raise RuntimeError(f"tnt.Model.{method}() needs a compiled model: call "
                               "model.compile(optimizer, loss, metrics) first.")

    # -- Keras' steps -----------------------------------------------------------------------------
    def train_step(self, data):
        """One pipelined step over the replica batch (Keras' loop calls it)."""
        data, sizes = _split_sizes(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        total = None if sizes is None else int(sizes.total)
        return self._tnt_stage.train_step(x, y, sample_weight, total)

    def test_step(self, data):
        """Forward-only step: metrics on the last stage, logs on every rank."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        return self._tnt_stage.test_step(x, y, sample_weight)

    def predict_step(self, data):
        """Forward-only step: the whole batch's outputs on every rank."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return keras.tree.map_structure(tf.convert_to_tensor, self._tnt_stage.predict_step(x))

    def reset_metrics(self):
        """Reset the last stage's metric states (Keras calls it per epoch)."""
        self._tnt_stage.reset_metrics()

    # -- data ----------------------------------------------------------------------------------------
    def _sharding(self) -> Sharding:
        """Every rank of a replica reads the replica's slice of each global batch."""
        return Sharding(rank=self.replica, size=self.num_replicas, shuffle_seed=self._common_seed())

    def _replica_data(self, x, y=None, sample_weight=None, *, batch_size, shuffle, method):
        return rank_dataset(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle, method=method,
                            sharding=self._sharding())

    def _prepare(self) -> None:
        if not self._tnt_synced:
            self._tnt_stage.sync_replicas()
            self._tnt_synced = True

    def _tnt_memory_layout(self) -> _memory.Holdings:
        """This stage: its weights, the sum of the micro-batches' gradients (summed in place;
        beside one micro-batch's where the backward could not be cut), the activations of the micro-batches its schedule keeps in flight
        (1F1B: min(p - s, m); GPipe: m) and their received boundary tensors."""
        p, m, s = self.num_pipeline_stages, self.num_micro_batches, self.stage
        in_flight = m if self.pipeline_schedule == "gpipe" else min(p - s, m)
        if self.virtual_stages > 1:  # in whole-stage sets: each chunk's is ~1/v of the stage's
            in_flight = -(-activation_bound(self.pipeline_schedule, p, m, self.virtual_stages) // self.virtual_stages)
        # remat="stages": one micro-batch's activations at a time (its re-run), the inputs of all
        activation_sets = 1 if self.remat else in_flight
        batch = getattr(self, "_tnt_memory_global_batch", None)
        rows = -(-batch // (self.num_replicas * m)) if batch else None
        bds = [self.plan.boundaries[b] for st in self._tnt_stage.chunks
               for b in (*st.inputs, *(() if st.is_last else st.outputs))]
        per_row = sum(int(np.prod(b.shape)) * np.dtype(b.dtype).itemsize for b in bds)
        return _memory.Holdings(
            model=self.stage_model, optimizer=self._tnt_stage.optimizer,
            what=f"{self.parallel_strategy.upper()}, stage {s} of {p}, m = {m}, {self.pipeline_schedule}"
                 + (", remat='stages'" if self.remat else ""),
            # the micro-batches' sum is the step's gradient set, summed in place inside W
            # (Note [Gradients summed in place]): no second set beside it, unless a chunk's
            # backward could not be cut (its tape returns a whole set beside the sum)
            accumulator_sets=0 if m == 1 or self._tnt_stage.executor.sums_in_place else 1,
            in_flight=in_flight, activation_sets=activation_sets, rows=rows,
            comm_gradient_sets=1 if self.num_replicas > 1 else 0, receive_bytes=per_row * (rows or 0))

    # -- loops ---------------------------------------------------------------------------------------
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, validation_batch_size=None, **kwargs):
        """Keras' ``fit``; ``x`` batched with the global batch size (or arrays + batch_size)."""
        self._assert_compiled("fit")
        self._tnt_memory_before_fit(x, batch_size)
        train, val = fit_datasets(
            x, y, sample_weight, sharding=self._sharding(), batch_size=batch_size, shuffle=shuffle,
            class_weight=class_weight, validation_split=validation_split, validation_data=validation_data,
            validation_batch_size=validation_batch_size)
        callbacks, backup = _backup.adapt(callbacks)
        if backup is not None:  # every rank reads its stage of the backup (and optimizer state)
            restored = backup.restore(self)
            if restored is not None:
                initial_epoch = restored
        if initial_epoch > 0:
            train = at_epoch(train, x, initial_epoch, kwargs.get("steps_per_epoch"))
        self._prepare()
        with self._rank_callbacks(callbacks) as rank_callbacks:
            try:
                return super().fit(train, epochs=epochs, verbose=self._verbose(verbose),
                                   callbacks=rank_callbacks, validation_data=val, shuffle=False,
                                   initial_epoch=initial_epoch, **kwargs)
            finally:
                self._tnt_stage.average_moving_statistics()

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=False, **kwargs):
        """Keras' ``evaluate`` (forward-only schedule); the same result on every rank."""
        if kwargs.get("_use_cached_eval_dataset"):  # validation inside fit: already split
            self._tnt_stage.average_moving_statistics()
            with self._tnt_whole():  # sharding=3: gathered once for the whole loop
                return super().evaluate(x, y, batch_size=batch_size, verbose=verbose,
                                        sample_weight=sample_weight, steps=steps, callbacks=callbacks,
                                        return_dict=return_dict, **kwargs)
        self._assert_compiled("evaluate")
        data = self._replica_data(x, y, sample_weight, batch_size=batch_size, shuffle=False,
                                  method="evaluate")
        self._prepare()
        self._tnt_stage.average_moving_statistics()
        with self._rank_callbacks(callbacks) as rank_callbacks, self._tnt_whole():
            logs = super().evaluate(data, verbose=self._verbose(verbose), steps=steps,
                                    callbacks=rank_callbacks, return_dict=True, **kwargs)
        if return_dict:
            return logs
        order = [k for k in self._tnt_stage.log_names if k in logs] or list(logs)
        values = [logs[k] for k in order]  # the last stage's order: loss first, as serial Keras
        return values[0] if len(values) == 1 else values

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Keras' ``predict`` (forward-only schedule); every rank returns all outputs in order."""
        data = self._replica_data(x, batch_size=batch_size, shuffle=False, method="predict")
        self._prepare()
        with self._rank_callbacks(callbacks) as rank_callbacks, self._tnt_whole():
            return super().predict(data, verbose=self._verbose(verbose), steps=steps,
                                   callbacks=rank_callbacks)

    # -- files (the base writes them; see _core.distributed) -------------------------------------
    def load_weights(self, filepath, *args, **kwargs) -> None:
        """Load a serial weights file; this rank keeps its stage's layers (and optimizer)."""
        with self._tnt_whole(gather=False):
            load_pipelined_weights(self, filepath)
        self._tnt_synced = False

    def _tnt_before_save(self) -> None:
        self._tnt_stage.average_moving_statistics()  # one model in the file, as on every replica

    def _write(self, filepath, overwrite: bool, all_devices: bool, with_optimizer: bool, write,
               kind: str | None = None) -> None:
        with self._tnt_whole():  # sharding=3: replica 0 of each stage serves whole weights
            super()._write(filepath, overwrite, all_devices, with_optimizer, write, kind)

    def _tnt_gather_serial(self, with_optimizer: bool = True) -> keras.Model | None:
        """The whole serial model with optimizer state on the master (None elsewhere); all
        ranks call it (``export``, and saves a stream does not cover)."""
        with self._tnt_whole():
            return gather_serial_model(self, with_optimizer)

    def _tnt_streamed(self, kind: str, with_optimizer: bool):
        """The serial file written by the master array by array, each stage sending its
        variables one at a time (``_saving.streamed_save``); all ranks call it."""
        return streamed_save(self, kind, with_optimizer)

    def _tnt_fill_serial(self, payloads: list[dict], with_optimizer: bool) -> keras.Model:
        """A new serial model holding the stages' ``payloads`` (weights and optimizer state
        by layer), compiled as this model is (the master's part of a gather)."""
        return fill_serial_model(self, payloads, with_optimizer)

    def _tnt_summary(self, *args, **kwargs) -> None:
        self.plan.summary()
