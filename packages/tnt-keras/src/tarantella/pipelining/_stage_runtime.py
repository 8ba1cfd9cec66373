"""One rank's stage for whole steps: schedule, then the end of the step.

End of a training step on stage s (docs/architecture.md, "Pipeline parallelism"):

1. the executor ran the schedule: gradients ``g_s`` = sum over micro-batches of the
   gradients of ``b_i / B`` x loss (accumulated in micro-batch order);
2. weight regularisation of the other stages is added to the last stage's loss tracker,
   so the logged loss is serial Keras' (one pipeline allreduce, only if some stage other
   than the last is regularised);
3. ``g_s`` is SUM-reduced over the replica group of stage s (ALL strategy);
4. with a ``LossScaleOptimizer``, whether every stage's ``g_s`` is finite is decided over
   the pipeline (one allreduce; after 3 every replica of a stage holds the same ``g_s``):
   one non-finite gradient anywhere skips the step on every stage and replica, as it
   skips serial Keras' step, and every stage's loss scale moves alike (a gradient serial
   Keras computes in float16 is checked as float16: ``_finite_over_pipeline``);
5. ``global_clipnorm`` scales by the norm over all stages of the unscaled gradients (one
   pipeline allreduce);
6. the stage's optimizer applies ``g_s`` (Keras' own ``LossScaleOptimizer`` unscales,
   skips and updates its scale, taking the decision of 4);
7. the last stage's metric states are summed over replicas and the results broadcast
   over the pipeline, so every rank returns the same logs.

The loss (and other stages' regularisation) is scaled by the optimizer's ``scale_loss``
before backprop, as Keras' own train step scales it (``_executor``).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

import keras
import numpy as np
import tensorflow as tf

from .._core import internals as _internals
from .._core import sparse as _sparse
from .._core import trace as _trace
from .._core.errors import PipelineError
from .._core.metric_states import metric_variables
from .._core.serial_files import clone_optimizer, optimizer_state
from .._core.serial_updates import update_one_variable_at_a_time
from .._core.sync import average_moving_statistics
from ._executor import StageExecutor
from ._passes import PREDICT, TEST, TRAIN
from ._plan import Plan
from ._schedule import micro_batch_sizes, num_chunks_per_stage
from ._shards import StageShards, check_enough_variables
from ._stages import ChunkStack, StageModel, build_chunks, build_stage
from ._ties import TiedGradients
from ._transport import Transport


def _released(grads: list) -> tuple[list, tuple]:
    """``grads`` for ``_apply_gradients``: a sum held in a ``tf.Variable`` (summed in place)
    as its handle, and the (position, dtype) of those, for the update to read and release."""
    held = tuple((i, g.dtype) for i, g in enumerate(grads) if isinstance(g, tf.Variable))
    return [g.handle if isinstance(g, tf.Variable) else g for g in grads], held


class StageRuntime:
    """Stage ``stage_index`` of ``plan`` on this rank, talking through ``transport``.

    Interleaved (``virtual_stages`` v > 1), ``plan``'s stages are the p * v chunks and this
    stage holds chunks ``stage, stage + p, ...``: ``chunks`` their models, ``model`` a
    ``ChunkStack`` of them (the variables the optimizer updates), ``metrics_model`` the
    model's last chunk where this stage holds it (its loss and metrics).
    """

    def __init__(self, plan: Plan, transport: Transport, schedule: str, num_micro_batches: int,
                 stage_model: StageModel | None = None, fusion_threshold_bytes: int = 8 << 20,
                 remat: str | None = None, virtual_stages: int | None = None, sharding: int = 0) -> None:
        """``sharding`` 1 or 2: the stage's replicas shard its optimizer state (and at 2 its
        gradients) over the replica group (``_shards``); 3: and its weights, gathered per stage
        per step (``_shards``' docstring); 0: each holds all of it."""
        self.plan = plan
        self.transport = transport
        self.num_micro_batches = num_micro_batches
        p, v = num_chunks_per_stage(plan, schedule, virtual_stages)
        if v > 1:
            if stage_model is not None:
                raise PipelineError("the interleaved schedule builds its stages' chunks itself: pipelines of "
                                    "tensor groups (tensor_parallel_size > 1) run 1f1b, gpipe or zb-h1.")
            if plan.ties:
                raise PipelineError(
                    f"the interleaved schedule does not run tied layers yet ({', '.join(t.layer for t in plan.ties)} "
                    "is called on several chunks); use pipeline_schedule='1f1b' (or 'zb-h1') for this model.")
            self.chunks = build_chunks(plan, transport.stage, p)
            self.model = ChunkStack([c.model for c in self.chunks], name=f"{plan.graph.model_name}_stage{transport.stage}")
        else:
            self.chunks = [stage_model or build_stage(plan, transport.stage)]
            self.model = self.chunks[0].model
        self.stage = self.chunks[0]
        self.is_last = any(c.is_last for c in self.chunks)
        self.metrics_model = self.chunks[-1].model if self.is_last else self.model
        self.last_stage = (plan.num_stages - 1) % p  # the stage holding the model's last chunk
        self.executor = StageExecutor(self.chunks if v > 1 else self.stage, plan, transport, schedule,
                                      remat=remat, virtual_stages=v)
        self.ties = TiedGradients(plan, self.model, transport)  # layers held on several stages
        self.optimizer: keras.optimizers.Optimizer | None = None
        self.global_clipnorm: float | None = None
        self.peak_live = 0
        self.peak_taped = 0
        self.schedule_seconds = 0.0  # wall time in schedules (train steps) ...
        self.busy_seconds = 0.0  # ... of which computing: 1 - busy/wall is the idle fraction
        # (start, end, busy seconds) of the last train schedules: with the other stages'
        # windows, the idle fraction over the pipeline's span of each step (bubble)
        self.windows: deque[tuple[float, float, float]] = deque(maxlen=10_000)
        self._others_regularized = any(st.has_regularizer for st in plan.stages[:-1])
        self._apply = None
        # Trainable variables the loss does not reach (agreed over the replicas at the first
        # step; tied copies excluded: another stage may reach them).
        self._no_gradient: frozenset[int] = frozenset()
        self._no_gradient_agreed = False
        self._reducer = None  # the step end over the replica group (EagerReducer), made at the first step
        # Trainable variables whose gradients came as IndexedSlices in the last step with
        # data (a replica without data sends none of their slices, not dense zeros).
        self._sparse_positions: dict[int, tf.DType] = {}  # -> the dtype of their indices
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.log_names: list[str] = []
        self.loss_scaled = False  # a LossScaleOptimizer: its decision is the pipeline's
        self._all_stages_finite = tf.Variable(True, trainable=False, name="tnt_all_stages_finite")
        self._float16_read: list[bool] = []  # per trainable variable: read as float16
        self.shards = StageShards(sharding, transport.replica_comm, fusion_threshold_bytes) \
            if sharding and transport.num_replicas > 1 else None

    # -- set-up ----------------------------------------------------------------------------------
    def compile(self, optimizer, loss=None, metrics=None, loss_weights=None, weighted_metrics=None) -> None:
        """Give the stage its own optimizer (a clone) and the last stage the loss and metrics."""
        opt = update_one_variable_at_a_time(clone_optimizer(optimizer))
        self.loss_scaled = isinstance(opt, keras.optimizers.LossScaleOptimizer)
        clipping = opt.inner_optimizer if self.loss_scaled else opt  # LSO clips in its inner one
        self.global_clipnorm = clipping.global_clipnorm
        if self.global_clipnorm:  # clipped here over all stages, not per stage
            clipping.global_clipnorm = None
        if self.loss_scaled:  # skip or apply as all stages decided (train_step), not this one
            opt.check_finite = lambda grads: self._all_stages_finite
        for chunk in self.chunks:  # one optimizer for all of them: it scales every chunk's loss
            if chunk.model is self.metrics_model:
                chunk.model.compile(optimizer=opt, loss=loss, metrics=metrics, loss_weights=loss_weights,
                                    weighted_metrics=weighted_metrics, jit_compile=False, auto_scale_loss=False)
            else:
                chunk.model.compile(optimizer=opt, loss=None, jit_compile=False, auto_scale_loss=False)
        trainable = self.model.trainable_variables
        if self.shards is not None:  # the owned variables' slots only
            self.shards.gather()  # level 3, compiled again: whole until the next sync frees them
            check_enough_variables(len(trainable), self.shards.size, self.transport.stage, self.shards.level,
                                   self.transport)
            self.shards.assign(trainable)
            trainable = self.shards.owned(trainable)
        opt.build(trainable)
        self.optimizer = opt
        self._float16_read = [f for chunk in self.chunks for f in float16_read_variables(chunk.model)]
        # reduce_retracing: sparse gradients hold as many slices as the step had tokens
        self._apply = tf.function(self._apply_gradients, autograph=False, reduce_retracing=True)

    def _apply_gradients(self, grads, held=()):
        # apply, not apply_gradients: a stage without trainable weights still moves its
        # loss scale (LossScaleOptimizer) with the other stages. Variables the loss does
        # not reach are left out, as serial Keras' apply_gradients leaves them out (a zero
        # gradient would still move them by weight decay).
        # ``held``: (position, dtype) of the gradients passed as the handles of the
        # variables they were summed in (``_released``): read, then the variables destroyed,
        # so each sum is freed once its variable's update has read it, not at the end.
        if held:
            grads = list(grads)
            handles = {i: grads[i] for i, _ in held}
            for i, dtype in held:
                grads[i] = tf.raw_ops.ReadVariableOp(resource=handles[i], dtype=dtype)
            with tf.control_dependencies([grads[i] for i, _ in held]):
                for i, _ in held:
                    tf.raw_ops.DestroyResourceOp(resource=handles[i], ignore_lookup_error=True)
        skip = self._no_gradient
        shards = self.shards
        pairs = [(g, v) for i, (g, v) in enumerate(zip(grads, self.model.trainable_variables))
                 if i not in skip and (shards is None or shards.owns(i))]
        self.optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
        return tf.constant(True)

    def sync_replicas(self) -> None:
        """Every replica of this stage starts from replica 0's weights and optimizer state;
        at level 3 each then stores only what it owns (from here on)."""
        if self.transport.num_replicas == 1:
            return
        trainable = self.model.trainable_variables
        if self.shards is not None:  # level 3 after a load or a recompile: whole first (a collective)
            self.shards.gather()
        variables = list(self.model.variables)
        if self.optimizer is not None and self.shards is None:  # sharded: each its own slots
            variables += list(self.optimizer.variables)
        for var in variables:
            value = np.asarray(var.numpy())
            var.assign(self.transport.replica_broadcast(value.reshape(-1)).reshape(value.shape))
        if self.shards is not None:
            self.shards.release(trainable)

    def gathered(self, values: bool = True):
        """While inside, this replica holds the stage's whole weights (level 3: gathered from
        their owners on entry, a collective over the replica group, freed on exit; ``values``
        False: zeros, no collective, for a load to overwrite); else nothing to do."""
        if self.shards is None:
            return contextlib.nullcontext()
        return self.shards.gathered(self.model.trainable_variables, values)

    def average_moving_statistics(self) -> None:
        """Replace each replica's batch-norm moving statistics of this stage by their mean
        over the stage's replicas (as DATA does over its ranks): each pipeline replica tracks
        the statistics of its own micro-batches, so without this the replicas of ALL predict
        and evaluate with different models and a file holds replica 0's alone."""
        if self.transport.num_replicas == 1:
            return
        average_moving_statistics(self.model, self.transport.replica_allreduce, self.transport.num_replicas)

    # -- steps -------------------------------------------------------------------------------------
    def _sizes(self, x_flat) -> tuple[int, list[int]]:
        n = int(x_flat[0].shape[0]) if x_flat else 0
        return n, micro_batch_sizes(n, self.num_micro_batches)

    def train_step(self, x, y, sample_weight, total: int | None = None) -> dict:
        rec = _trace.recorder()
        if rec is None:
            return self._train_step(x, y, sample_weight, total)
        t0 = time.perf_counter()
        last = rec.meta.get("last_step_end")
        if last is not None:  # Keras' loop between two steps: the next batch, the callbacks
            rec.add("between steps", "host", "data", last, t0, stage=self.stage.index)
        try:
            return self._train_step(x, y, sample_weight, total)
        finally:
            rec.meta["last_step_end"] = end = time.perf_counter()
            rec.add("step", "step", "step", t0, end, stage=self.stage.index,
                    step=self.executor.step, schedule=self.executor.schedule)

    def _train_step(self, x, y, sample_weight, total: int | None) -> dict:
        x_flat = keras.tree.flatten(x)
        n, sizes = self._sizes(x_flat)
        total = n if total is None else int(total)
        variables = self.model.trainable_variables
        if self.shards is not None:  # level 3: the stage's whole weights before the first forward
            self.shards.gather()
        result = self.executor.run(TRAIN, x_flat, y, sample_weight, sizes, max(total, 1))
        self.peak_live = max(self.peak_live, result.peak_live)
        self.peak_taped = max(self.peak_taped, result.peak_taped)
        self.schedule_seconds += result.seconds
        self.busy_seconds += result.busy_seconds
        self.windows.append((*result.window, result.busy_seconds))
        if result.grads is not None:
            grads = result.grads
            self._sparse_positions = {i: g.indices.dtype for i, g in enumerate(grads) if _sparse.is_sparse(g)}
        else:  # no micro-batch on this replica: no slices, zeros, as the other replicas expect
            grads = [_sparse.no_slices(v, self._sparse_positions[i]) if i in self._sparse_positions
                     else tf.zeros_like(v)
                     for i, v in enumerate(variables)]
        self._add_other_stages_regularization(n)
        if self.shards is not None:  # level 3: after the last backward, before the update
            self.shards.release(variables)
        if not self._no_gradient_agreed:
            self._agree_no_gradient(len(variables))
        if self.transport.num_replicas > 1 or self.ties or self.loss_scaled or self.global_clipnorm:
            grads = [g.value() if isinstance(g, tf.Variable) else g for g in grads]  # combined as tensors
        rec = _trace.recorder()
        t0 = time.perf_counter()
        grads = self._reduce_over_replicas(grads)
        if rec and self.transport.num_replicas > 1:
            rec.add("gradient sync", "sync", "sync", t0, time.perf_counter(), stage=self.stage.index,
                    step=self.executor.step)
        if self.ties:  # the stages holding a tied layer add their gradients: copies stay equal
            grads = self.ties.sum(grads, self.executor.step)
        finite = True
        if self.loss_scaled:
            finite = self._finite_over_pipeline(grads)
            self._all_stages_finite.assign(finite)
        if self.global_clipnorm and finite:  # a skipped step is not clipped (nor applied)
            grads = self._clip_over_pipeline(grads)
        self._apply(*_released(grads))
        del grads
        if self.shards is not None and self.shards.level < 3:  # the owners' updated values to every replica
            self.shards.gather_values(self.model.trainable_variables)
        return self._logs()

    def _agree_no_gradient(self, count: int) -> None:
        """Fix which variables the optimizer skips, the same on every replica of the stage
        (a replica without a micro-batch in the first step ran no backward pass)."""
        known = self.executor.no_gradient
        reached = np.zeros(count, np.int32)  # 1: some replica's loss reaches it
        if known is not None:
            reached[:] = 1
            reached[list(known)] = 0
        ran = np.array([int(known is not None)], np.int32)
        if self.transport.num_replicas > 1:
            reached = self.transport.replica_allreduce(reached)
            ran = self.transport.replica_allreduce(ran)
        if ran[0] == 0:
            return  # no replica has run a backward pass yet: decide at a later step
        tied = self.ties.positions() if self.ties else set()
        self._no_gradient = frozenset(int(i) for i in np.flatnonzero(reached == 0) if int(i) not in tied)
        self._no_gradient_agreed = True
        self._apply = tf.function(self._apply_gradients, autograph=False, reduce_retracing=True)

    def test_step(self, x, y, sample_weight) -> dict:
        x_flat = keras.tree.flatten(x)
        n, sizes = self._sizes(x_flat)
        with self.gathered():
            self.executor.run(TEST, x_flat, y, sample_weight, sizes, max(n, 1))
            self._add_other_stages_regularization(n)
        return self._logs()

    def predict_step(self, x):
        """The model's outputs for the whole batch of all replicas, on every rank."""
        x_flat = keras.tree.flatten(x)
        n, sizes = self._sizes(x_flat)
        with self.gathered():
            result = self.executor.run(PREDICT, x_flat, None, None, sizes, max(n, 1))
        outputs = None
        if self.is_last:
            graph = self.plan.graph
            outputs = []
            for k, name in enumerate(graph.outputs):
                parts = [np.asarray(p[k]) for p in result.predictions]
                info = graph.tensors[name]
                local = np.concatenate(parts) if parts else np.zeros((0, *info.shape), info.dtype)
                outputs.append(self.transport.replica_allgather(local))
        outputs = self.transport.pipeline_broadcast_object(outputs, self.last_stage)
        return keras.tree.pack_sequence_as(self.plan.graph.output_struct, outputs)

    # -- end-of-step pieces --------------------------------------------------------------------------
    def _add_other_stages_regularization(self, n: int) -> None:
        if not self._others_regularized:
            return
        mine = float(self.executor.regularization_value())  # the last chunk's is in its loss
        total = float(self.transport.pipeline_allreduce(np.array([mine], np.float64))[0])
        if self.is_last and n > 0:
            tracker = _internals.loss_tracker(self.metrics_model)
            tracker.total.assign_add(tf.cast(total * n, tracker.total.dtype))

    def _reduce_over_replicas(self, grads: list) -> list:
        """SUM over the stage's replica group with the fused engine (buckets, in order);
        sparse gradients gathered in replica order afterwards (Note [Sparse gradients as
        serial]: replica order is the serial order of the global batch's rows). The eager
        glue of the one step end (``_reducer``, Note [One step end])."""
        if self.transport.num_replicas == 1:
            return grads
        variables = self.model.trainable_variables
        gather = lambda g: _sparse.allgather_eager(g, self.transport.replica_allgather)  # noqa: E731
        if self._reducer is None:
            self._reducer = self.transport.eager_reducer(self.fusion_threshold_bytes)
        if self.shards is None or self.shards.level < 2:
            return self._reducer.reduce(grads, variables, gather)
        # Level 2: the dense gradients reduce-scattered (None where another replica owns the
        # variable); sparse ones and tied copies (summed over stages next) summed whole.
        tied = self.ties.positions() if self.ties else set()
        whole = [i for i, g in enumerate(grads) if _sparse.is_sparse(g) or i in tied]
        out: list = [None] * len(grads)
        if whole:
            for i, g in zip(whole, self._reducer.reduce([grads[i] for i in whole], [variables[i] for i in whole],
                                                         gather)):
                out[i] = g
        scattered = self.shards.reduce_scatter(grads, [i for i in range(len(grads)) if i not in whole])
        for i, g in scattered.items():
            out[i] = g
        return out

    def _finite_over_pipeline(self, grads: list) -> bool:
        """True iff the gradients of every stage are finite (the same answer on all ranks).

        A variable its layer reads as float16 (``mixed_float16``) gets a float16 gradient
        in serial Keras, which overflows when the sum over the whole batch does; here its
        micro-batches' (and replicas') parts were summed in float32, so the sum is checked
        in float16: it overflows where serial Keras' does (up to the rounding of the parts).
        """
        half = self._float16_read or [False] * len(grads)
        mine = all(bool(_sparse.all_finite(g, as_float16=h)) for g, h in zip(grads, half) if g is not None)
        flag = np.array([0.0 if mine else 1.0], np.float64)
        if self.shards is not None and self.shards.level >= 2:  # a replica holds its own sums only
            flag = self.transport.replica_allreduce(flag)
        non_finite = self.transport.pipeline_allreduce(flag)[0]
        return bool(non_finite == 0)

    def _loss_scale(self):
        """What the optimizer divides the gradients by before clipping (Keras' order)."""
        if self.loss_scaled:
            return self.optimizer.dynamic_scale
        return self.optimizer.loss_scale_factor

    def _clip_over_pipeline(self, grads: list) -> list:
        """Keras' ``clip_by_global_norm`` with the norm of all stages' unscaled gradients."""
        scale = self._loss_scale()
        unscaled = grads if scale is None else [g if g is None else _sparse.divide(g, scale) for g in grads]
        own = [g for i, g in enumerate(unscaled) if i not in self.ties.replica_positions]  # a tie once
        scattered = self.shards is not None and self.shards.level >= 2
        if scattered:  # each gradient counted by its owner, then summed over the replica group
            own = [g for i, g in enumerate(unscaled) if i not in self.ties.replica_positions and self.shards.owns(i)]
        local = np.array([float(tf.add_n([_sparse.squared_sum(g) for g in own])) if own else 0.0], np.float64)
        if scattered:
            local = self.transport.replica_allreduce(local)
        norm = np.float32(np.sqrt(self.transport.pipeline_allreduce(local)[0]))
        clip = np.float32(self.global_clipnorm)
        scale = clip * np.minimum(np.float32(1.0) / norm, np.float32(1.0) / clip) + (norm - norm)
        return [g if g is None else _sparse.scale(g, scale) for g in grads]

    def whole_optimizer_state(self) -> dict[str, np.ndarray] | None:
        """The stage's whole optimizer state by key on replica 0 (None on the others);
        collective over the replica group when the state is sharded."""
        mine = optimizer_state(self.optimizer, self.model)
        if self.shards is None:
            return mine if self.transport.replica == 0 else None
        return self.shards.whole_state(mine)

    def _logs(self) -> dict:
        logs = None
        if self.is_last:
            logs = self._global_metric_results()
        logs = self.transport.pipeline_broadcast_object(logs, self.last_stage)
        self.log_names = list(logs)  # Keras' order (loss first): evaluate's list follows it
        return logs

    def _global_metric_results(self) -> dict:
        model = self.metrics_model
        if self.transport.num_replicas == 1:
            return _pythonify(model.get_metrics_result())
        mvars = metric_variables(model)
        local = [np.asarray(v.numpy()) for v in mvars]
        flat = np.concatenate([a.astype(np.float64).reshape(-1) for a in local]) if local else np.zeros(0)
        summed = self.transport.replica_allreduce(flat)
        offset = 0
        for var, a in zip(mvars, local):
            var.assign(summed[offset: offset + a.size].reshape(a.shape).astype(a.dtype))
            offset += a.size
        results = _pythonify(model.get_metrics_result())
        for var, a in zip(mvars, local):
            var.assign(a)
        return results

    def reset_metrics(self) -> None:
        if self.is_last:
            for metric in self.metrics_model.metrics:
                metric.reset_state()


def float16_read_variables(model: keras.Model) -> list[bool]:
    """Per trainable variable of ``model``: whether serial Keras differentiates it in float16
    (the one rule of every strategy: ``_internals.float16_differentiated``, Note [Float16
    overflow as serial] in ``_grad_sync``)."""
    in_float16 = _internals.float16_differentiated(model)
    return [id(v) in in_float16 for v in model.trainable_variables]


def _pythonify(logs: dict) -> dict:
    out = {}
    for key, value in logs.items():
        arr = np.asarray(value)
        out[key] = float(arr) if arr.ndim == 0 else arr
    return out
