"""The distributed train, test and predict steps of a wrapped Keras model.

Data flow of one training step on rank r with micro-batch b_r of global batch B
(see docs/architecture.md, "Data flow of one training step"):

1. Metric states are read (``s0``) and reset, so that the step's updates leave exactly
   this rank's contribution ``c_r`` in them.
2. Forward pass and Keras' own loss (mean over the micro-batch, plus regularisation).
3. The loss tracker and compiled metrics are updated, giving ``c_r``.
4. Backprop; each fusion bucket of gradients ``g_r`` (scaled by ``b_r``) is submitted as
   soon as its last gradient exists.
5. One fused SUM-allreduce returns ``B = sum b_r``, ``sum c_r`` and ``sum b_r g_r``.
6. Metric states become ``s0 + sum c_r`` (exact global metrics); the optimizer applies
   ``sum b_r g_r / B``, the gradient of the global mean loss — identical on all ranks.

Scaling by ``b_r / B`` rather than ``1 / N`` keeps the serial result when ``B % N != 0``
and for a last batch smaller than ``N`` (a rank with an empty micro-batch contributes
zeros but still takes part). With one rank the steps are Keras' own.

Sparse gradients (an Embedding's ``tf.IndexedSlices``) stay sparse: they are not in
the fused allreduce; after it, every rank's slices are gathered in rank order (``_sparse``,
Note [Sparse gradients as serial]), so the optimizer sees serial Keras' slices.

A wrapped model that defines its own ``train_step``/``test_step``/``predict_step`` runs
it instead (``_custom_steps``). Metric states are merged by ``_metric_states``.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

import tnt_data

from .._core import internals as _internals
from .._core import settings as _settings
from .._core import sparse as _sparse
from .._core.batch_norm import has_sync_batch_norm, valid_rows
from .._core.metric_states import MetricExchange, metric_variables
from .._core.reducer import GraphReducer, Slot, start_token
from .._core.step_parts import (
    allgather_rows,
    first_tensor,
    local_batch_size,
    nonempty,
    overrides,
    split_sizes,
)
from . import _grad_sync


def _slot(name: str, var) -> Slot:
    return Slot(name, tuple(int(d) for d in var.shape), tf.as_dtype(var.dtype))


class DistributedSteps:
    """Builds the step functions for ``model`` on ``size`` ranks.

    The reducers are created on first use, after the model, its metrics and its
    optimizer are built, because their slots are those variables.

    ``comm``: the ranks that share the global batch (a tensor-parallel model's replica
    group; default the whole job, ``size`` ranks). ``own_steps=False``: ``model`` is a
    tnt wrapper whose ``train_step`` delegates here, not a user's step to honour.
    ``in_graph_collectives``: the forward/backward pass runs collectives of its own (on
    another group), so no bucket starts before backprop ended (never two at once).
    """

    def __init__(self, model: keras.Model, size: int, threshold_bytes: int, *, comm=None,
                 own_steps: bool = True, in_graph_collectives: bool = False, sharding=None) -> None:
        self._model = model
        self._sharding = sharding  # _sharding.Sharding of a sharded replica (sharding >= 1), else None
        self._size = size
        self._threshold = threshold_bytes
        self._comm = comm
        self._no_gradient: frozenset[int] = frozenset()  # positions the loss does not reach
        self._own_steps = own_steps
        self._in_graph_collectives = in_graph_collectives
        self._sparse_as_dense = _settings.sparse_as_dense()
        # Positions (in trainable_variables) whose gradients are IndexedSlices: known once
        # the local part was traced; they are gathered, not in the reducer's slots.
        self._sparse_positions: tuple[int, ...] | None = None
        self._train_reducer: GraphReducer | None = None
        self._train_reducer_sparse: tuple[int, ...] | None = None  # the positions it was made for
        self._test_reducer: GraphReducer | None = None
        self._sizes_reducer_: GraphReducer | None = None  # made for user-distributed data only
        self._train_metrics = MetricExchange(model)
        self._test_metrics = MetricExchange(model)
        self._compiled_fns: dict[tuple[str, bool], object] = {}  # (part, jit) -> tf.function
        from ._custom_steps import CustomSteps

        self._custom = CustomSteps(model, threshold_bytes)

    # -- reducers -----------------------------------------------------------------
    def _metric_slots(self) -> list[Slot]:
        return [_slot(f"metric:{v.path}", v) for v in metric_variables(self._model)]

    def _trainable_in_backprop_order(self) -> list:
        # Backprop produces the last layer's gradients first; submitting (and bucketing)
        # in that order lets the first buckets start while earlier layers still compute.
        # Variables with sparse gradients are gathered instead (not reducer slots).
        sparse = set(self._sparse_positions or ())
        dense = [v for i, v in enumerate(self._model.trainable_variables) if i not in sparse]
        return list(reversed(dense))

    def train_reducer(self) -> GraphReducer:
        """The reducer of a training step: batch size, metric states, dense gradients
        (remade when a retrace finds other sparse gradients)."""
        if self._train_reducer is not None and self._train_reducer_sparse != self._sparse_positions:
            self._train_reducer.close()  # a retrace found other sparse gradients: new slots
            self._train_reducer = None
        if self._train_reducer is None:
            self._train_reducer_sparse = self._sparse_positions
            slots = [Slot("batch_size", (1,), tf.float32), *self._metric_slots()]
            if not self._scatters():  # level 2 reduce-scatters the gradients instead
                slots += [_slot(f"grad:{v.path}", v) for v in self._trainable_in_backprop_order()]
            self._train_reducer = GraphReducer(slots, self._threshold, self._comm)
        return self._train_reducer

    def _sizes_reducer(self) -> GraphReducer:
        """The reducer of the step's global batch size alone (Note [Global batch first])."""
        if self._sizes_reducer_ is None:
            self._sizes_reducer_ = GraphReducer([Slot("local_batch_size", (1,), tf.float32)], self._threshold,
                                                self._comm)
        return self._sizes_reducer_

    def _global_sizes(self, x) -> tnt_data.StepSizes:
        """This step's local and global sample counts, the global one summed over the group
        before backprop. Note [Global batch first]: without known sizes (a user-distributed
        dataset, ``tnt_distribute_dataset=False``) each rank weighted its gradient by ``b_r``
        and divided the sum by ``B``; a loss-scaled gradient that fits float32, as serial
        Keras' does, could overflow on the way, so a LossScaleOptimizer skipped a step serial
        Keras applied (1 of 8 at scale 2^127 on 2 ranks, weights 0.069 off). Knowing ``B``
        first, each rank weights its loss by ``b_r / B`` as with tnt's own input split."""
        local_n = local_batch_size(x)
        total = self._sizes_reducer().reduce([tf.reshape(tf.cast(local_n, tf.float32), [1])])[0][0]
        return tnt_data.StepSizes(local_n, total)

    def _scatters(self) -> bool:
        return self._sharding is not None and self._sharding.level >= 2

    def test_reducer(self) -> GraphReducer:
        """The reducer of an evaluation step: batch size and metric states."""
        if self._test_reducer is None:
            slots = [Slot("batch_size", (1,), tf.float32), *self._metric_slots()]
            self._test_reducer = GraphReducer(slots, self._threshold, self._comm)
        return self._test_reducer

    def close(self) -> None:
        """Release the reducers' engines (a new compile makes new steps)."""
        for reducer in (self._train_reducer, self._test_reducer, self._sizes_reducer_):
            if reducer is not None:
                reducer.close()
        self._train_reducer = self._test_reducer = self._sizes_reducer_ = None
        self._custom.close()

    def _forward_loss(self, x, y, sample_weight, training: bool):
        model = self._model
        y_pred = model(x, training=training)
        loss = model.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
        )
        return y_pred, loss

    def _update_metrics(self, x, y, y_pred, sample_weight, loss, local_n) -> None:
        model = self._model
        # The loss tracker is a weighted Mean: weight b_r makes its reduced state the
        # global mean over B samples, exactly as serial Keras computes it.
        _internals.loss_tracker(model).update_state(loss, sample_weight=local_n)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # -- steps -----------------------------------------------------------------------
    def _compiled(self, name: str, fn):
        """``fn`` as a nested tf.function, XLA-compiled when the wrapped model asks for it.

        The exchange cannot live inside XLA, so a distributed step is cut around it:
        everything before (forward, loss, backprop) and everything after (metrics,
        optimizer) is compiled as Keras would compile the whole serial step.
        """
        if tf.executing_eagerly():  # run_eagerly=True: stay debuggable
            return fn
        # Synchronised batch norm's collectives are graph ops XLA cannot compile, nor are a
        # sharded update's (global norm, finiteness, allgather of updated values).
        jit = (bool(getattr(self._model, "jit_compile", False)) and not has_sync_batch_norm(self._model)
               and not (name == "global" and self._sharding is not None) and self._layer_shards() is None)
        if (name, jit) not in self._compiled_fns:
            self._compiled_fns[(name, jit)] = tf.function(fn, jit_compile=jit, autograph=False)
        return self._compiled_fns[(name, jit)]

    def _gradients(self, x, y, sample_weight, local_n, weight):
        """This rank's forward pass, metric updates and gradients of ``weight`` x its loss."""
        model = self._model
        shards = self._layer_shards()
        anchor = None if shards is None or shards.current() is None else shards.current().anchor
        with tf.GradientTape() as tape:
            if anchor is not None:  # level 3: every layer's backward runs on every replica
                tape.watch(anchor)
            y_pred, loss = self._forward_loss(x, y, sample_weight, training=True)
            # Weighting the loss (not the gradient) by b_r / B keeps every per-sample
            # term of backprop at its serial magnitude: with float16 compute, a loss
            # averaged over b_r < B samples would overflow sooner than serial.
            grad_loss = loss if weight is None else loss * tf.cast(weight, loss.dtype)
            scaled_loss = model.optimizer.scale_loss(grad_loss)
        self._update_metrics(x, y, y_pred, sample_weight, loss, local_n)
        variables = model.trainable_variables
        if not variables:
            raise ValueError("The model has no trainable weights: nothing to train.")
        # Level 3: a variable another replica owns holds no value (the tape would read its handle).
        held = [i for i, v in enumerate(variables) if shards is None or not shards.is_released(v)]
        sources = [variables[i] for i in held] + ([anchor] if anchor is not None else [])
        held_grads = tape.gradient(scaled_loss, sources)[:len(held)]
        grads = [None] * len(variables)
        for i, g in zip(held, held_grads):
            grads[i] = g
        # Structural (the same on every rank and step): see _without_gradient.
        self._no_gradient = frozenset(i for i, g in enumerate(grads) if g is None)
        # Sparse gradients stay sparse, as Keras' own step hands them to the optimizer
        # (Note [Sparse gradients as serial]), unless the user asked for sparse_as_dense.
        densify = _sparse.to_dense if self._sparse_as_dense else (lambda g: g)
        # tf.zeros of the shape: a level-3 variable another replica owns holds no value to read.
        return [tf.zeros(v.shape, v.dtype) if g is None else densify(g) for g, v in zip(grads, variables)]

    def _without_gradient(self, grads: list) -> list:
        """``grads`` with None again where the loss does not reach the variable. The
        exchange needs a tensor for each (zeros), but the optimizer must not see one:
        serial Keras' ``apply_gradients`` drops such a variable, and a zero gradient would
        still move it by weight decay (AdamW, ``weight_decay=``)."""
        return [None if i in self._no_gradient else g for i, g in enumerate(grads)]

    def _layer_shards(self):
        """Level 3's per-layer plan (``_layer_shards.LayerShards``), else None."""
        return None if self._sharding is None else self._sharding.layers

    def _per_layer_positions(self) -> tuple[set[int], list[int]]:
        """Level 3: (positions gathered per layer, those of them this replica owns)."""
        shards = self._layer_shards()
        if shards is None:
            return set(), []
        positions = shards.per_layer_positions()
        owned = self._sharding.owned_mask()
        return positions, [i for i in sorted(positions) if owned[i]]

    def _local_part(self, x, y, sample_weight, sizes):
        """Everything before the exchange: returns the metric states before the step and
        the values to SUM over ranks (``b_r``, metric contributions, weighted gradients);
        at level 3 also the owned per-layer gradients (already summed over the replicas by
        each layer's reduce-scatter) and the token of the step's last per-layer collective."""
        local_n = tf.cast(sizes.local, tf.int32)
        x, y, sample_weight = nonempty((x, y, sample_weight), local_n)
        begun = self._train_metrics.begin(first_tensor(x))
        weight = tf.cast(sizes.local, tf.float32) / tf.cast(sizes.total, tf.float32)
        has_data = local_n > 0
        b = tf.cast(local_n, tf.float32)
        shards = self._layer_shards()
        per_layer, owned_per_layer = self._per_layer_positions()
        level3 = (shards.step(has_data=has_data) if shards is not None
                  else contextlib.nullcontext())
        with self._train_metrics.watch(), valid_rows(local_n), level3 as state:
            grads = self._gradients(x, y, sample_weight, local_n, weight)
        tail = tf.identity(state.token) if state is not None else tf.zeros((), tf.int32)
        before, contribution = self._train_metrics.contributions(begun, local_n, has_data)
        self._sparse_positions = tuple(i for i, g in enumerate(grads) if _sparse.is_sparse(g))
        sparse = [_sparse.keep_rows_if(g, has_data) for g in grads if _sparse.is_sparse(g)]
        dense = [g for i, g in enumerate(grads) if not _sparse.is_sparse(g) and i not in per_layer]
        # No tf.where pass here: the reducer submits zeros for the gradients of a rank
        # without data (GraphReducer.reduce, keep=has_data).
        to_reduce = [tf.reshape(b, [1]), *contribution, *reversed(dense)]
        presummed = [grads[i] for i in owned_per_layer]
        return before, to_reduce, sparse, has_data, presummed, tail

    def _global_part(self, before, reduced, sparse, after=(), presummed=()):
        """Everything after the exchange: global metric states, then the optimizer step
        (a sharded one's allgather after ``after``, the step's reduce-scatter; level 3's
        owned per-layer sums in ``presummed``)."""
        offset = 1 + len(before)
        global_n = reduced[0][0]
        self._train_metrics.finish(before, reduced[1:offset], global_n)
        dense = iter(reversed(reduced[offset:]))
        gathered = iter(sparse)
        positions = set(self._sparse_positions or ())
        per_layer, owned_per_layer = self._per_layer_positions()
        summed = dict(zip(owned_per_layer, presummed))
        grads = [summed.get(i) if i in per_layer else next(gathered) if i in positions else next(dense)
                 for i in range(len(self._model.trainable_variables))]
        grads = _grad_sync.overflow_as_serial(self._model, grads)  # Note [Float16 overflow as serial]
        if self._sharding is not None:  # the owned variables only, then their values gathered
            with _grad_sync.already_reduced():
                return self._sharding.apply(self._model.optimizer, self._without_gradient(grads),
                                            self._model.trainable_variables, after=after,
                                            settled=[r for r in reduced if r is not None and not _sparse.is_sparse(r)])
        with _grad_sync.already_reduced():
            self._model.optimizer.apply_gradients(zip(self._without_gradient(grads), self._model.trainable_variables))
        return tf.constant(True)

    def _scatter(self, reversed_dense: list, has_data, after: list) -> tuple[list, list]:
        """Level 2: ``reversed_dense`` (the dense gradients, last variable first) reduce-scattered
        over the replicas, None where another replica owns the variable; and the collective's
        last output (what the allgather of values must wait for)."""
        sparse = set(self._sparse_positions or ()) | self._per_layer_positions()[0]
        positions = [i for i in range(len(self._model.trainable_variables)) if i not in sparse]
        variables = self._model.trainable_variables
        # The variable's static shape: a Dense on a 3-D input has a kernel gradient of shape
        # (None, units) in the graph, and the scatter's sizes are counted from these shapes.
        dense = {i: tf.ensure_shape(g, variables[i].shape) for i, g in zip(positions, reversed(reversed_dense))}
        owned, done = self._sharding.reduce_scatter(dense, has_data, after)
        return [owned.get(i) for i in reversed(positions)], done

    # Note [Reduce-scatter during backprop]
    # Level 2 reduce-scatters the dense gradients bucket by bucket (Sharding.scatter_buckets:
    # backprop order, large buckets first) on the replicas' communicator. Each bucket's
    # collective waits only for the start token (and level 3's or an in-graph collective's
    # end, which the start then waits for), the collective before it and its own gradients:
    # not for the fused allreduce of batch size and metric states, nor for the rest of
    # backprop. So it runs while earlier layers' gradients are still computed, and the
    # bucket's local gradients are freed then, not after backprop (where they stood beside
    # the owned sums: the 4 Psi level 2 did not save, docs/sharding.md "Memory and speed").
    # Safe to interleave with the fused allreduce: its engine reduces over a communicator of
    # its own (tnt_comm's Note [One communicator per engine]), and its waits begin only after
    # the last reduce-scatter: both kinds block an executor thread, and with one inter-op
    # thread a rank blocked in a fused wait (for a bucket another rank has not submitted yet,
    # its only thread blocked in a reduce-scatter this rank has not reached) would hang both.
    # Its submits are not held back, so its bytes still move during backprop. Everything else on the
    # replicas' communicator (sparse gathers, the update's norm and finiteness allreduces,
    # the allgathers of values) waits for the last reduce-scatter, on every rank alike.

    def train_step(self, data) -> dict:
        """One training step on this rank's micro-batch; gradients and metric states summed
        over the group, then the serial update applied (or the model's own train_step)."""
        model = self._model
        data, sizes = split_sizes(data)
        if self._own_steps and overrides(model, "train_step"):
            return self._custom.train_step(data, self._size)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if self._size == 1:  # Keras' own step (the wrapper runs it under Keras' jit setting)
            grads = self._gradients(x, y, sample_weight, local_batch_size(x), None)
            model.optimizer.apply_gradients(zip(self._without_gradient(grads), model.trainable_variables))
            return model.get_metrics_result()
        start = start_token()  # made before backprop: see _reducer, "start token"
        if sizes is None:  # Note [Global batch first]; the exchange starts after this reduction
            sizes = self._global_sizes(x)
            with tf.control_dependencies([sizes.total]):
                start = tf.identity(start)
        before, to_reduce, sparse, has_data, presummed, tail = self._compiled("local", self._local_part)(
            x, y, sample_weight, sizes)
        if self._in_graph_collectives or has_sync_batch_norm(model) or self._layer_shards() is not None:
            # Their collectives run inside backprop: no bucket may start before they end,
            # or ranks could interleave the two kinds differently.
            with tf.control_dependencies([*to_reduce, tail, *presummed]):
                start = tf.identity(start)
        offset = 1 + len(before)
        scattered = to_reduce[offset:] if self._scatters() else None
        if scattered is not None:
            to_reduce = to_reduce[:offset]
        scatter_done = []
        if scattered is not None:  # level 2: each replica receives the sums of its own only
            # During backprop, after nothing but the start (Note [Reduce-scatter during backprop]).
            owned, scatter_done = self._scatter(scattered, has_data, after=[start, tail])
        reduced = self.train_reducer().reduce(
            to_reduce, start=start, keep=has_data, keep_from=offset,
            wait_after=scatter_done[0] if scatter_done else None,
        )
        if scattered is not None:
            reduced = reduced + owned
        # After the fused allreduce (Note [Sparse gradients as serial]) and level 2's
        # reduce-scatters (the same communicator) on every rank.
        sparse = [_sparse.allgather(g, self._comm, after=[reduced[0], *scatter_done]) for g in sparse]
        if scattered is not None:  # the update's collectives after the gathers on every rank
            scatter_done = [*scatter_done, *(g.values for g in sparse)] or [tail]
        done = self._compiled("global", self._global_part)(before, reduced, sparse, scatter_done,
                                                           presummed)
        with tf.control_dependencies([done]):  # read the metrics after they became global
            return model.get_metrics_result()

    def test_step(self, data) -> dict:
        """One evaluation step; metric states summed over the group."""
        model = self._model
        data, _ = split_sizes(data)
        if self._own_steps and overrides(model, "test_step"):
            return self._custom.test_step(data, self._size)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        local_n = local_batch_size(x)
        if self._size == 1:
            y_pred, loss = self._forward_loss(x, y, sample_weight, training=False)
            self._update_metrics(x, y, y_pred, sample_weight, loss, local_n)
            return model.get_metrics_result()
        start = start_token()
        x, y, sample_weight = nonempty((x, y, sample_weight), local_n)
        begun = self._test_metrics.begin(first_tensor(x))
        with self._test_metrics.watch(), self._inference() as state:
            y_pred, loss = self._forward_loss(x, y, sample_weight, training=False)
            self._update_metrics(x, y, y_pred, sample_weight, loss, local_n)
        if state is not None:  # the fused allreduce after level 3's per-layer allgathers
            with tf.control_dependencies([state.token]):
                start = tf.identity(start)
        has_data = local_n > 0
        before, contribution = self._test_metrics.contributions(begun, local_n, has_data)
        b = tf.reshape(tf.cast(local_n, tf.float32), [1])
        reduced = self.test_reducer().reduce([b, *contribution], start=start)
        done = self._test_metrics.finish(before, reduced[1:], reduced[0][0])
        with tf.control_dependencies(done):
            return model.get_metrics_result()

    def predict_step(self, data):
        """This rank's predictions, gathered in rank order (the global batch's order)."""
        data, _ = split_sizes(data)
        if self._own_steps and overrides(self._model, "predict_step"):
            return self._custom.predict_step(data, self._size)
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        if self._size == 1:
            return self._model(x, training=False)
        local_n = local_batch_size(x)
        with self._inference() as state:
            y_pred = self._model(nonempty(x, local_n), training=False)
        after = [] if state is None else [state.token]
        with tf.control_dependencies(after):  # the rows' allgather after level 3's per-layer ones
            y_pred = tf.nest.map_structure(tf.identity, y_pred)
        return tf.nest.map_structure(lambda t: allgather_rows(t[:local_n], self._comm), y_pred)

    def _inference(self):
        """Level 3: a forward pass gathering each layer's weights (no backward); else nothing."""
        shards = self._layer_shards()
        return shards.step(backward=False) if shards is not None else contextlib.nullcontext()
