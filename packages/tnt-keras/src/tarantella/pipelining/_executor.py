"""Run one stage's action list for one step: micro-batches in, gradients out.

Forward passes run under a ``tf.GradientTape`` around the stage's compiled forward
function, so the activations of micro-batch i stay alive (inside the tape) until B(i)
asks the tape for the gradients of the stage's outputs (given the received output
gradients) with respect to its boundary inputs and its weights. Sends are non-blocking
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
from ._plan import Plan
from ._receive_ahead import Receive, ReceiveAhead
from ._schedule import actions
from ._shapes import BoundaryShapes
from ._stages import StageModel
from ._transport import ACTIVATION, GRADIENT, Transport, message_tag

TRAIN, TEST, PREDICT = "train", "test", "predict"


@dataclass
class StepResult:
    """What a stage produced in one step."""

    grads: list | None = None  # accumulated weighted gradients (train), None if no micro-batch
    predictions: list = field(default_factory=list)  # last stage, predict: one output per micro-batch
    peak_live: int = 0  # the most micro-batches held in tapes at once
    seconds: float = 0.0  # wall time of the schedule
    window: tuple[float, float] = (0.0, 0.0)  # its start and end, time.time() (comparable across ranks of a host)
    busy_seconds: float = 0.0  # of which computing forward/backward passes (the rest is waiting)


def _slice(structure, lo: int, hi: int):
    return keras.tree.map_structure(lambda t: None if t is None else t[lo:hi], structure)


class StageExecutor:
    """Executes the schedule of one stage (``stage``) of ``plan`` through ``transport``."""

    def __init__(self, stage: StageModel, plan: Plan, transport: Transport, schedule: str) -> None:
        self.stage = stage
        self.model = stage.model
        self.plan = plan
        self.transport = transport
        self.schedule = schedule
        self.step = 0
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
        todo = actions(plan, self.schedule, len(sizes), st.index, training=training)
        inbox = ReceiveAhead(t, [self._receive(a, step, offsets) for a in todo
                                 if a.kind in ("RECV_ACT", "RECV_GRAD")])
        for a in todo:
            i = a.micro_batch
            lo, hi = offsets[i], offsets[i + 1]
            if a.kind == "RECV_ACT":
                received.setdefault(i, {})[a.boundary] = inbox.next()
            elif a.kind == "F":
                inputs = [parts[i] for parts in data_parts]
                inputs += [received[i].pop(b) for b in st.inputs]
                received.pop(i, None)
                t0 = time.perf_counter()
                live[i] = self._run_forward(mode, i, inputs, y, sample_weight, lo, hi, total, result,
                                            outputs_np)
                result.busy_seconds += time.perf_counter() - t0
                result.peak_live = max(result.peak_live, len(live))
                if not training:
                    live.pop(i)
            elif a.kind == "SEND_ACT":
                sends.append(t.isend(outputs_np[i][a.boundary], a.peer,
                                     (step, i, message_tag(a.boundary, ACTIVATION))))
            elif a.kind == "RECV_GRAD":
                arr = inbox.next()
                got = out_grads.setdefault(i, {})
                got[a.boundary] = arr if a.boundary not in got else got[a.boundary] + arr
            elif a.kind == "B":
                outputs_np.pop(i, None)
                sends = [r for r in sends if not r.test()]  # completed sends let go of their arrays
                t0 = time.perf_counter()
                d_inputs, grads = self._run_backward(live.pop(i), out_grads.pop(i, {}), variables)
                d_inputs = [np.asarray(d) for d in d_inputs]
                result.busy_seconds += time.perf_counter() - t0
                in_grads[i] = d_inputs
                pending[i] = grads
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
            elif a.kind == "SEND_GRAD":
                k = [b for b in st.inputs if plan.boundaries[b].differentiable].index(a.boundary)
                sends.append(t.isend(np.asarray(in_grads[i][k]), a.peer,
                                     (step, i, message_tag(a.boundary, GRADIENT))))
                if k == len(self._grad_positions) - 1:
                    in_grads.pop(i, None)
        for request in sends:
            request.wait()
        result.seconds = time.perf_counter() - started
        result.window = (started_at, started_at + result.seconds)
        return result

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
        tape = tf.GradientTape() if training else None
        watched = [inputs[k] for k in self._grad_positions]
        if tape is not None:
            tape.__enter__()
            tape.watch(watched)
        try:
            if st.is_last:
                y_i, sw_i = _slice(y, lo, hi), _slice(sample_weight, lo, hi)
                y_pred, loss = self._forward_loss(training)(inputs, y_i, sw_i)
                targets = [self._scaled(loss * tf.cast(weight, loss.dtype))]
            else:
                outs, reg = self._forward(training)(inputs)
                targets = [outs[k] for k in self._grad_outputs]
                if self._regularized:
                    targets.append(self._scaled(reg * weight))
        finally:
            if tape is not None:
                tape.__exit__(None, None, None)
        if st.is_last:
            self._update_metrics()(y_i, y_pred, sw_i, loss, tf.constant(hi - lo, tf.float32))
        else:
            outputs_np[i] = {b: np.asarray(o) for b, o in zip(st.outputs, outs)}
        return tape, watched, targets

    def _scaled(self, loss):
        """``loss`` as Keras' train step differentiates it (the optimizer's loss scale)."""
        optimizer = self.model.optimizer
        return loss if optimizer is None else optimizer.scale_loss(loss)

    def _run_backward(self, record, received: dict, variables):
        tape, watched, targets = record
        if self.stage.is_last:
            output_gradients = None
        else:
            output_gradients = [received[self.stage.outputs[k]] for k in self._grad_outputs]
            if self._regularized:
                output_gradients.append(tf.ones((), targets[-1].dtype))
        sources = [*watched, *variables]
        grads = tape.gradient(targets, sources, output_gradients=output_gradients)
        # A source without a path to the targets (an untied output embedding the model never
        # calls) gets zeros: Keras' optimizers leave it as serial Keras does (no gradient
        # moves no weight under Adam/SGD), and every stage/replica sends a tensor for it.
        # (UnconnectedGradients.ZERO fails on Keras variables: their dtype is a string.)
        grads = [tf.zeros(tuple(src.shape), tf.as_dtype(str(src.dtype))) if g is None else g
                 for g, src in zip(grads, sources)]
        weight_grads = grads[len(watched):]
        if self._sparse_as_dense:
            weight_grads = [_sparse.to_dense(g) for g in weight_grads]
        return grads[: len(watched)], weight_grads
