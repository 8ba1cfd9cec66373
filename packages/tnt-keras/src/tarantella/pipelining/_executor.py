"""Run one stage's action list for one step: micro-batches in, gradients out.

Forward passes run under a ``tf.GradientTape`` around the stage's compiled forward
function, so the activations of micro-batch i stay alive (inside the tape) until B(i)
asks the tape for the gradients of the stage's outputs (given the received output
gradients) with respect to its boundary inputs and its weights. Under a schedule that
splits the backward (ZB-H1) the tape is persistent: B(i) asks it for the gradients with
respect to the boundary inputs only (sent upstream at once), W(i) later for those with
respect to the weights, and then lets it go. In TensorFlow each ``gradient`` call runs
the recorded forward's backward function, so B and W each cost about one joint backward
pass: the split buys a shorter critical path upstream at the price of extra compute
(docs/pipelining.md, "ZB-H1"). With ``remat="stages"`` (Note [Stage recomputation]) the
forward runs without a tape and keeps only its inputs; B re-runs it under a tape first.
Sends are non-blocking
and waited for at the end of the step; each receive is posted one message ahead of the
action that takes it (``ReceiveAhead``), so it lands while the stage computes.

Loss weighting (docs/architecture.md, "The mesh"): the last stage differentiates ``loss_i * b_i / B`` (B = the
global batch), every other stage adds its regularisation loss weighted alike, so summed
over the micro-batches of all replicas each counts exactly once. Both are scaled by the
optimizer's ``scale_loss`` (a ``LossScaleOptimizer``'s dynamic scale, a static
``loss_scale_factor``), as Keras' own train step scales its loss: weighting the loss, not
the gradients, keeps every backprop term at its serial magnitude, so float16 overflows
where serial Keras' step overflows (the micro-batches' float32 sum of a float16 gradient is
checked in float16: ``StageRuntime._finite_over_pipeline``). Weight gradients are
accumulated in micro-batch order, whatever order the schedule ran the backward passes in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import keras
import numpy as np
import tensorflow as tf

from .._core import internals as _internals
from .._core import settings as _settings
from .._core import sparse as _sparse
from .._core import trace as _trace
from ._plan import Plan
from ._receive_ahead import Receive, ReceiveAhead
from ._remat import STAGES, Recompute, StageState
from ._schedule import SPLIT_BACKWARD, verify
from ._shapes import BoundaryShapes
from ._stages import StageModel
from ._transport import ACTIVATION, GRADIENT, Transport, message_tag

TRAIN, TEST, PREDICT = "train", "test", "predict"


@dataclass
class StepResult:
    """What a stage produced in one step."""

    grads: list | None = None  # accumulated weighted gradients (train), None if no micro-batch
    predictions: list = field(default_factory=list)  # last stage, predict: one output per micro-batch
    peak_live: int = 0  # the most micro-batches in flight at once (forward done, backward not)
    peak_taped: int = 0  # of those, the most holding their activations (in a tape) at once
    seconds: float = 0.0  # wall time of the schedule
    window: tuple[float, float] = (0.0, 0.0)  # its start and end, time.time() (comparable across ranks of a host)
    busy_seconds: float = 0.0  # of which computing forward/backward passes (the rest is waiting)


def _taped(live: dict) -> int:
    """Micro-batches in ``live`` whose activations are held (not kept for recomputation)."""
    return sum(1 for r in live.values() if not isinstance(r, Recompute))


def _slice(structure, lo: int, hi: int):
    return keras.tree.map_structure(lambda t: None if t is None else t[lo:hi], structure)


class StageExecutor:
    """Executes the schedule of one stage (``stage``) of ``plan`` through ``transport``."""

    def __init__(self, stage: StageModel, plan: Plan, transport: Transport, schedule: str,
                 remat: str | None = None) -> None:
        self.stage = stage
        self.remat = remat == STAGES
        self.model = stage.model
        self.plan = plan
        self.transport = transport
        self.schedule = schedule
        self.step = 0
        # Positions (in the stage's trainable variables) the loss does not reach: structural,
        # known after the first backward pass. Their gradients travel as zeros, but the
        # optimizer skips them, as serial Keras' does (the stage runtime's apply).
        self.no_gradient: frozenset[int] | None = None
        self._fns: dict = {}
        self._sparse_as_dense = _settings.sparse_as_dense()
        self._shapes = BoundaryShapes(plan)  # dynamic axes: from each step's input shapes
        self._step_shapes: list[tuple] = []
        self._regularized = any(getattr(v, "regularizer", None) is not None
                                for v in self.model.trainable_weights) or any(
            getattr(layer, "activity_regularizer", None) is not None for layer in self.model.layers)
        n_data = len(stage.data_inputs)
        self._grad_positions = [n_data + k for k, b in enumerate(stage.inputs)
                                if plan.boundaries[b].differentiable]
        self._grad_outputs = [k for k, b in enumerate(stage.outputs) if plan.boundaries[b].differentiable]
        self._split = schedule in SPLIT_BACKWARD
        self._actions: dict[tuple[int, bool], list] = {}  # (micro-batches, training) -> verified list
        self._state = StageState(self.model) if self.remat else None

    # -- compiled pieces ---------------------------------------------------------------------
    def _fn(self, key, make):
        if key not in self._fns:
            self._fns[key] = tf.function(make(), reduce_retracing=True, autograph=False)
        return self._fns[key]

    def _forward(self, training: bool):
        model = self.model

        def make():
            def forward(inputs):
                outs = keras.tree.flatten(model(inputs, training=training))
                losses = model.losses
                reg = tf.add_n([tf.cast(v, tf.float32) for v in losses]) if losses else tf.zeros(())
                return outs, reg
            return forward
        return self._fn(("forward", training), make)

    def _forward_loss(self, training: bool):
        model = self.model

        def make():
            def forward_loss(inputs, y, sample_weight):
                y_pred = model(inputs, training=training)
                loss = model.compute_loss(x=None, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                          training=training)
                return y_pred, loss
            return forward_loss
        return self._fn(("forward_loss", training), make)

    def _update_metrics(self):
        model = self.model

        def make():
            def update(y, y_pred, sample_weight, loss, n):
                _internals.loss_tracker(model).update_state(loss, sample_weight=n)
                model.compute_metrics(None, y, y_pred, sample_weight=sample_weight)
                return tf.constant(True)
            return update
        return self._fn(("metrics",), make)

    def regularization_value(self) -> float:
        """This stage's weight-regularisation loss (what serial Keras adds to every step's loss)."""
        terms = [v.regularizer(v) for v in self.model.trainable_weights
                 if getattr(v, "regularizer", None) is not None]
        return float(tf.add_n([tf.cast(t, tf.float32) for t in terms])) if terms else 0.0

    # -- one step ------------------------------------------------------------------------------
    def run(self, mode: str, x_flat: list, y, sample_weight, sizes: list[int], total: int) -> StepResult:
        """Run the step's schedule over micro-batches of ``sizes`` (global batch ``total``)."""
        self.step += 1
        step = self.step
        st, plan, t = self.stage, self.plan, self.transport
        training = mode == TRAIN
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        received: dict[int, dict[int, tf.Tensor]] = {}
        outputs_np: dict[int, dict[int, np.ndarray]] = {}
        out_grads: dict[int, dict[int, tf.Tensor]] = {}
        in_grads: dict[int, list] = {}
        live: dict[int, tuple] = {}
        sends = []
        result = StepResult()
        pending: dict[int, list] = {}
        next_to_add = 0
        variables = self.model.trainable_variables
        started, started_at = time.perf_counter(), time.time()

        # One split per input: along axis 0 TensorFlow hands out the rows without copying
        # (a slice per micro-batch copied each, ~1 ms per 4 MiB).
        data_parts = [tf.split(x_flat[j], sizes) for j in st.data_inputs]
        self._step_shapes = self._shapes.shapes([tuple(x.shape) for x in x_flat])
        todo = self._todo(len(sizes), training)
        rec = _trace.recorder()
        lane_args = {"stage": st.index, "step": step}
        inbox = ReceiveAhead(t, [self._receive(a, step, offsets) for a in todo
                                 if a.kind in ("RECV_ACT", "RECV_GRAD")])
        for a in todo:
            i = a.micro_batch
            lo, hi = offsets[i], offsets[i + 1]
            if a.kind == "RECV_ACT":
                t0 = time.perf_counter()
                received.setdefault(i, {})[a.boundary] = inbox.next()
                if rec:
                    rec.add("recv act", "recv", "comm", t0, time.perf_counter(), peer=a.peer, mb=i, **lane_args)
            elif a.kind == "F":
                inputs = [parts[i] for parts in data_parts]
                inputs += [received[i].pop(b) for b in st.inputs]
                received.pop(i, None)
                t0 = time.perf_counter()
                live[i] = self._run_forward(mode, i, inputs, y, sample_weight, lo, hi, total, result,
                                            outputs_np)
                t1 = time.perf_counter()
                result.busy_seconds += t1 - t0
                if rec:
                    rec.add(f"F{i}", "forward", "compute", t0, t1, mb=i, **lane_args)
                result.peak_live = max(result.peak_live, len(live))
                result.peak_taped = max(result.peak_taped, _taped(live))
                if not training:
                    live.pop(i)
            elif a.kind == "SEND_ACT":
                t0 = time.perf_counter()
                sends.append(t.isend(outputs_np[i][a.boundary], a.peer,
                                     (step, i, message_tag(a.boundary, ACTIVATION))))
                if rec:
                    rec.add("send act", "send", "comm", t0, time.perf_counter(), peer=a.peer, mb=i,
                            bytes=int(outputs_np[i][a.boundary].nbytes), **lane_args)
            elif a.kind == "RECV_GRAD":
                t0 = time.perf_counter()
                arr = inbox.next()
                if rec:
                    rec.add("recv grad", "recv", "comm", t0, time.perf_counter(), peer=a.peer, mb=i, **lane_args)
                got = out_grads.setdefault(i, {})
                got[a.boundary] = arr if a.boundary not in got else got[a.boundary] + arr
            elif a.kind == "B":
                outputs_np.pop(i, None)
                sends = [r for r in sends if not r.test()]  # completed sends let go of their arrays
                t0 = time.perf_counter()
                if self._split:  # B: input gradients only; W(i) takes the weights' later
                    record = live[i] = self._recomputed(live[i])
                    result.peak_taped = max(result.peak_taped, _taped(live))
                    d_inputs = self._run_backward_inputs(record, out_grads.pop(i, {}))
                else:
                    record = self._recomputed(live.pop(i))
                    result.peak_taped = max(result.peak_taped, _taped(live) + 1)
                    d_inputs, grads = self._run_backward(record, out_grads.pop(i, {}), variables)
                    del record
                    pending[i] = grads
                d_inputs = [np.asarray(d) for d in d_inputs]
                t1 = time.perf_counter()
                result.busy_seconds += t1 - t0
                if rec:
                    rec.add(f"B{i}", "backward", "compute", t0, t1, mb=i, **lane_args)
                in_grads[i] = d_inputs
            elif a.kind == "W":
                t0 = time.perf_counter()
                pending[i] = self._run_backward_weights(live.pop(i), variables)
                t1 = time.perf_counter()
                result.busy_seconds += t1 - t0
                if rec:
                    rec.add(f"W{i}", "weight", "compute", t0, t1, mb=i, **lane_args)
            elif a.kind == "SEND_GRAD":
                k = [b for b in st.inputs if plan.boundaries[b].differentiable].index(a.boundary)
                t0 = time.perf_counter()
                sends.append(t.isend(np.asarray(in_grads[i][k]), a.peer,
                                     (step, i, message_tag(a.boundary, GRADIENT))))
                if rec:
                    rec.add("send grad", "send", "comm", t0, time.perf_counter(), peer=a.peer, mb=i, **lane_args)
                if k == len(self._grad_positions) - 1:
                    in_grads.pop(i, None)
            if a.kind in ("B", "W"):
                while next_to_add in pending:  # accumulate in micro-batch order
                    g = pending.pop(next_to_add)
                    # Sparse gradients: slices concatenated in micro-batch order, as serial
                    # Keras' one lookup over the whole batch orders them (_sparse).
                    # One variable at a time, each micro-batch's tensor dropped once added:
                    # the step holds the sum and one micro-batch's gradients, never a third
                    # full set of new sums beside them (issue 29).
                    if result.grads is None:
                        result.grads = g
                    else:
                        for k in range(len(g)):
                            result.grads[k] = _sparse.accumulate(result.grads[k], g[k])
                            g[k] = None
                    del g
                    next_to_add += 1
        t0 = time.perf_counter()
        for request in sends:
            request.wait()
        if rec and sends:
            rec.add("send wait", "send", "comm", t0, time.perf_counter(), **lane_args)
        result.seconds = time.perf_counter() - started
        result.window = (started_at, started_at + result.seconds)
        return result

    def _todo(self, num_micro_batches: int, training: bool) -> list:
        """This stage's action list, the whole pipeline's checked once per shape (``verify``)."""
        key = (num_micro_batches, training)
        if key not in self._actions:
            self._actions[key] = verify(self.plan, self.schedule, num_micro_batches, training)[self.stage.index]
        return self._actions[key]

    def _receive(self, a, step: int, offsets: list[int]) -> Receive:
        """The message a RECV_ACT or RECV_GRAD action expects."""
        bd = self.plan.boundaries[a.boundary]
        kind = ACTIVATION if a.kind == "RECV_ACT" else GRADIENT
        rows = offsets[a.micro_batch + 1] - offsets[a.micro_batch]
        return Receive(a.peer, (step, a.micro_batch, message_tag(a.boundary, kind)), bd.dtype,
                       (rows, *self._step_shapes[a.boundary]))

    def _run_forward(self, mode, i, inputs, y, sample_weight, lo, hi, total, result, outputs_np):
        st = self.stage
        training = mode == TRAIN
        weight = tf.constant((hi - lo) / total, tf.float32)
        if mode == PREDICT and st.is_last:
            result.predictions.append(self._forward(False)(inputs)[0])
            return None
        y_i, sw_i = (_slice(y, lo, hi), _slice(sample_weight, lo, hi)) if st.is_last else (None, None)
        before = self._state.snapshot() if training and self.remat else None
        record = self._taped_forward(training, inputs, y_i, sw_i, weight,
                                     taped=training and not self.remat)
        tape, watched, targets, outs = record
        if st.is_last:
            y_pred, loss = outs
            self._update_metrics()(y_i, y_pred, sw_i, loss, tf.constant(hi - lo, tf.float32))
        else:
            outputs_np[i] = {b: np.asarray(o) for b, o in zip(st.outputs, outs)}
        if before is not None:  # keep the inputs (and the state they met), not the activations
            return Recompute(inputs, y_i, sw_i, weight, before)
        return [tape, watched, targets]

    def _taped_forward(self, training: bool, inputs, y_i, sw_i, weight, *, taped: bool):
        """The stage's forward (with the loss on the last stage), under a tape when ``taped``:
        (tape, watched boundary inputs, differentiated targets, outputs)."""
        st = self.stage
        tape = tf.GradientTape(persistent=self._split) if taped else None
        watched = [inputs[k] for k in self._grad_positions]
        if tape is not None:
            tape.__enter__()
            tape.watch(watched)
        try:
            if st.is_last:
                y_pred, loss = self._forward_loss(training)(inputs, y_i, sw_i)
                targets = [self._scaled(loss * tf.cast(weight, loss.dtype))]
                outs = (y_pred, loss)
            else:
                outs, reg = self._forward(training)(inputs)
                targets = [outs[k] for k in self._grad_outputs]
                if self._regularized:
                    targets.append(self._scaled(reg * weight))
        finally:
            if tape is not None:
                tape.__exit__(None, None, None)
        return tape, watched, targets, outs

    def _recomputed(self, record):
        """A taped record for backward: ``record`` itself, or (remat) the forward of a
        ``Recompute`` re-run under a tape from the state it first met."""
        if not isinstance(record, Recompute):
            return record
        with self._state.restored(record.state):
            tape, watched, targets, _ = self._taped_forward(True, record.inputs, record.y, record.sample_weight,
                                                            record.weight, taped=True)
        return [tape, watched, targets]

    def _scaled(self, loss):
        """``loss`` as Keras' train step differentiates it (the optimizer's loss scale)."""
        optimizer = self.model.optimizer
        return loss if optimizer is None else optimizer.scale_loss(loss)

    def _output_gradients(self, targets, received: dict):
        if self.stage.is_last:
            return None
        output_gradients = [received[self.stage.outputs[k]] for k in self._grad_outputs]
        if self._regularized:
            output_gradients.append(tf.ones((), targets[-1].dtype))
        return output_gradients

    def _run_backward_inputs(self, record, received: dict) -> list:
        """B of a split backward: the gradients of the boundary inputs; keeps the output
        gradients in ``record`` for W."""
        tape, watched, targets = record
        output_gradients = self._output_gradients(targets, received)
        record.append(output_gradients)
        if not watched:
            return []
        grads = tape.gradient(targets, watched, output_gradients=output_gradients)
        return [tf.zeros(tuple(src.shape), src.dtype) if g is None else g for g, src in zip(grads, watched)]

    def _run_backward_weights(self, record, variables) -> list:
        """W of a split backward: the weight gradients of the micro-batch whose B ran."""
        tape, _watched, targets, output_gradients = record
        grads = tape.gradient(targets, list(variables), output_gradients=output_gradients)
        del record[:], tape  # the persistent tape holds the activations until now
        self.no_gradient = frozenset(i for i, g in enumerate(grads) if g is None)
        grads = [tf.zeros(tuple(src.shape), tf.as_dtype(str(src.dtype))) if g is None else g
                 for g, src in zip(grads, variables)]
        if self._sparse_as_dense:
            grads = [_sparse.to_dense(g) for g in grads]
        return grads

    def _run_backward(self, record, received: dict, variables):
        tape, watched, targets = record
        output_gradients = self._output_gradients(targets, received)
        sources = [*watched, *variables]
        grads = tape.gradient(targets, sources, output_gradients=output_gradients)
        self.no_gradient = frozenset(i - len(watched) for i, g in enumerate(grads) if g is None and i >= len(watched))
        # A source without a path to the targets (an untied output embedding the model never
        # calls) gets zeros, so that every stage/replica sends a tensor for it; the stage's
        # optimizer step leaves it out (``no_gradient``), as serial Keras' does.
        # (UnconnectedGradients.ZERO fails on Keras variables: their dtype is a string.)
        grads = [tf.zeros(tuple(src.shape), tf.as_dtype(str(src.dtype))) if g is None else g
                 for g, src in zip(grads, sources)]
        weight_grads = grads[len(watched):]
        if self._sparse_as_dense:
            weight_grads = [_sparse.to_dense(g) for g in weight_grads]
        return grads[: len(watched)], weight_grads
