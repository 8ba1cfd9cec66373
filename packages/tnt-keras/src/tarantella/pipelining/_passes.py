"""The compiled passes of one model chunk: its forward (taped or not), B, W and joint backward.

A stage holds one chunk (GPipe, 1F1B, ZB-H1) or several (interleaved: chunks r, r + p, ...);
the executor (``_executor``) runs the schedule and asks the chunk of each action for its
pass. Everything here depends on one chunk's Keras model only: its compiled functions, which
of its inputs and outputs carry gradients, its regularisation and (``remat="stages"``) the
state a re-run must start from. Loss weighting and scaling: see ``_executor``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from .._core import internals as _internals
from .._core import settings as _settings
from .._core import sparse as _sparse
from ._plan import Plan
from ._remat import STAGES, Recompute, StageState
from ._schedule import SPLIT_BACKWARD
from ._split_backward import SplitBackward, SplitRecord, SplitUnavailable
from ._stages import StageModel

TRAIN, TEST, PREDICT = "train", "test", "predict"

try:  # a variable without a value: the first micro-batch's gradient becomes its value, uncopied
    from tensorflow.python.ops.resource_variable_ops import UninitializedVariable as _Uninitialized

    def _sum_into(shape: tuple, dtype) -> tf.Variable:
        return _Uninitialized(shape=shape, dtype=dtype, trainable=False)
except ImportError:  # pragma: no cover - another TensorFlow: sums returned, added as tensors
    _sum_into = None


@dataclass
class _SplitTaped:
    """A split forward's record (Note [Split backward]): the cut forward's record, the tape
    over what follows the function (the loss' weighting and scaling), its outputs and targets."""

    split: SplitRecord
    tape: tf.GradientTape
    outputs: list  # the function's flat outputs, None where not differentiable
    targets: list
    output_gradients: list | None = None


def _slice(structure, lo: int, hi: int):
    return keras.tree.map_structure(lambda t: None if t is None else t[lo:hi], structure)


class ChunkPasses:
    """The passes of chunk ``stage`` (a plan stage) of ``plan`` under ``schedule``."""

    def __init__(self, stage: StageModel, plan: Plan, schedule: str, remat: str | None = None) -> None:
        self.stage = stage
        self.remat = remat == STAGES
        self.model = stage.model
        self.plan = plan
        # Positions (in the chunk's trainable variables) the loss does not reach: structural,
        # known after the first backward pass. Their gradients travel as zeros, but the
        # optimizer skips them, as serial Keras' does (the stage runtime's apply).
        self.no_gradient: frozenset[int] | None = None
        self._fns: dict = {}
        self._sparse_as_dense = _settings.sparse_as_dense()
        self._regularized = any(getattr(v, "regularizer", None) is not None
                                for v in self.model.trainable_weights) or any(
            getattr(layer, "activity_regularizer", None) is not None for layer in self.model.layers)
        n_data = len(stage.data_inputs)
        self._grad_positions = [n_data + k for k, b in enumerate(stage.inputs)
                                if plan.boundaries[b].differentiable]
        self._grad_outputs = [k for k, b in enumerate(stage.outputs) if plan.boundaries[b].differentiable]
        self._split = schedule in SPLIT_BACKWARD
        self._state = StageState(self.model) if self.remat else None
        # B and W cut out of TensorFlow's backward (Note [Split backward]), under every
        # schedule: W sums the gradients in place (Note [Gradients summed in place]). On a
        # graph it cannot cut, the tape (persistent under ZB-H1: W recomputes the backward)
        # and why, here
        self._splitter = SplitBackward()
        self.split_fallback: str | None = None

    @property
    def sums_in_place(self) -> bool:
        """Whether W sums the dense weight gradients into the micro-batch sum (Note
        [Gradients summed in place]): the backward is cut (or not tried yet) and TensorFlow
        has variables without a value."""
        return self._splitter is not None and _sum_into is not None

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


    def forward(self, mode, inputs, y, sample_weight, lo, hi, total):
        """The forward of rows ``lo:hi`` (of a global batch ``total``): (what the backward
        needs or None, the outputs to send by boundary or None, the prediction or None)."""
        st = self.stage
        training = mode == TRAIN
        weight = tf.constant((hi - lo) / total, tf.float32)
        if mode == PREDICT and st.is_last:
            return None, None, self._forward(False)(inputs)[0]
        y_i, sw_i = (_slice(y, lo, hi), _slice(sample_weight, lo, hi)) if st.is_last else (None, None)
        before = self._state.snapshot() if training and self.remat else None
        record = self._taped_forward(training, inputs, y_i, sw_i, weight,
                                     taped=training and not self.remat)
        tape, watched, targets, outs = record
        sent = None
        if st.is_last:
            y_pred, loss = outs
            self._update_metrics()(y_i, y_pred, sw_i, loss, tf.constant(hi - lo, tf.float32))
        else:
            sent = {b: np.asarray(o) for b, o in zip(st.outputs, outs)}
        if before is not None:  # keep the inputs (and the state they met), not the activations
            return Recompute(inputs, y_i, sw_i, weight, before), sent, None
        return tape if isinstance(tape, _SplitTaped) else [tape, watched, targets], sent, None

    def _taped_forward(self, training: bool, inputs, y_i, sw_i, weight, *, taped: bool):
        """The stage's forward (with the loss on the last stage), under a tape when ``taped``:
        (tape, watched boundary inputs, differentiated targets, outputs)."""
        if taped and self._splitter is not None:
            try:
                return self._split_forward(training, inputs, y_i, sw_i, weight)
            except SplitUnavailable as exc:
                self._splitter = None
                self.split_fallback = str(exc)
                if self._split:
                    warnings.warn(f"pipeline stage {self.stage.index}: ZB-H1's W cannot be cut from B ({exc}); "
                                  "this stage's W recomputes the backward pass (results unchanged, W as slow as a "
                                  "backward)", stacklevel=2)
        st = self.stage
        tape = tf.GradientTape(persistent=self._split) if taped else None
        watched = [inputs[k] for k in self._grad_positions]
        if tape is not None:
            tape.__enter__()
            tape.watch(watched)
        try:
            if st.is_last:
                outs = tuple(self._forward_loss(training)(inputs, y_i, sw_i))  # (y_pred, loss)
                targets = self._targets(outs, weight)
            else:
                result = self._forward(training)(inputs)  # (outputs, regularization)
                targets = self._targets(result, weight)
                outs = result[0]
        finally:
            if tape is not None:
                tape.__exit__(None, None, None)
        return tape, watched, targets, outs

    def _targets(self, outs, weight) -> list:
        """What the backward differentiates: the weighted, scaled loss on the last stage
        (``outs`` = (prediction, loss)); else the differentiable outputs and the weighted,
        scaled regularization (``outs`` = (outputs, regularization))."""
        if self.stage.is_last:
            return [self._scaled(outs[1] * tf.cast(weight, outs[1].dtype))]
        targets = [outs[0][k] for k in self._grad_outputs]
        if self._regularized:
            targets.append(self._scaled(outs[1] * weight))
        return targets

    def _split_forward(self, training: bool, inputs, y_i, sw_i, weight):
        """The taped forward for a split backward: the function's forward runs as TensorFlow's
        first-order forward (its intermediates kept for B and W); a tape records only what
        follows it (the targets), as the joint backward's tape records it."""
        last = self.stage.is_last
        fn = self._forward_loss(training) if last else self._forward(training)
        args = (inputs, y_i, sw_i) if last else (inputs,)
        split = self._splitter.forward(fn, args, self._grad_positions)
        outs = split.outputs
        flat = keras.tree.flatten(outs)
        if len(flat) != split.cut.num_inference_outputs:
            raise SplitUnavailable("the forward's outputs do not flatten as its function's")
        sources = [o if o.dtype.is_floating or o.dtype.is_complex else None for o in flat]
        with tf.GradientTape() as tape:
            tape.watch([o for o in sources if o is not None])
            targets = self._targets(outs, weight)
        return _SplitTaped(split, tape, sources, targets), None, targets, outs if last else outs[0]

    def recomputed(self, record):
        """A taped record for backward: ``record`` itself, or (remat) the forward of a
        ``Recompute`` re-run under a tape from the state it first met."""
        if not isinstance(record, Recompute):
            return record
        with self._state.restored(record.state):
            tape, watched, targets, _ = self._taped_forward(True, record.inputs, record.y, record.sample_weight,
                                                            record.weight, taped=True)
        return tape if isinstance(tape, _SplitTaped) else [tape, watched, targets]

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

    def backward_inputs(self, record, received: dict) -> list:
        """B of a split backward: the gradients of the boundary inputs; keeps the output
        gradients in ``record`` for W."""
        if isinstance(record, _SplitTaped):
            return self._split_inputs(record, received)
        tape, watched, targets = record
        output_gradients = self._output_gradients(targets, received)
        record.append(output_gradients)
        if not watched:
            return []
        grads = tape.gradient(targets, watched, output_gradients=output_gradients)
        return [tf.zeros(tuple(src.shape), src.dtype) if g is None else g for g, src in zip(grads, watched)]

    def backward_weights(self, record, variables, sums: list | None = None) -> list:
        """W of a split backward: the weight gradients of the micro-batch whose B ran.

        ``sums`` (only when this micro-batch is the next to be summed: ``[]`` for the first,
        else the sums per variable so far) lets a cut W sum its dense gradients in place
        (Note [Gradients summed in place]): at those positions the returned list holds the
        ``tf.Variable`` of the sum (a new one for the first micro-batch), the gradient added."""
        if isinstance(record, _SplitTaped):
            grads = self._split_weights(record, variables, sums)
        else:
            tape, _watched, targets, output_gradients = record
            grads = tape.gradient(targets, list(variables), output_gradients=output_gradients)
            del record[:], tape  # the persistent tape holds the activations until now
        self.no_gradient = frozenset(i for i, g in enumerate(grads) if g is None)
        grads = [tf.zeros(tuple(src.shape), tf.as_dtype(str(src.dtype))) if g is None else g
                 for g, src in zip(grads, variables)]
        if self._sparse_as_dense:
            grads = [_sparse.to_dense(g) for g in grads]
        return grads

    def _split_inputs(self, record: _SplitTaped, received: dict) -> list:
        sources = record.outputs
        output_gradients = self._output_gradients(record.targets, received)
        present = [o for o in sources if o is not None]
        grads = iter(record.tape.gradient(record.targets, present, output_gradients=output_gradients))
        d_outputs = [None if o is None else next(grads) for o in sources]
        record.tape = record.targets = record.outputs = None
        d_inputs = self._splitter.backward_inputs(record.split, d_outputs)
        return [tf.zeros(tuple(src.shape), src.dtype) if g is None else g
                for g, src in zip(d_inputs, record.split.watched)]

    def _split_weights(self, record: _SplitTaped, variables, sums: list | None) -> list:
        positions = record.split.positions(variables)
        if sums is None or _sum_into is None:
            by_position = self._splitter.backward_weights(record.split)
            return [None if p is None else by_position[p] for p in positions]
        dense = record.split.cut.w_dense
        first = not sums
        into: dict[int, tf.Variable] = {}  # variable index -> the variable its gradient goes into
        for k, (p, v) in enumerate(zip(positions, variables)):
            if p is None or p not in dense:
                continue
            if first:
                into[k] = _sum_into(tuple(v.shape), record.split.cut.w_structure[p].dtype)
            elif isinstance(sums[k], tf.Variable):
                into[k] = sums[k]
        by_position = self._splitter.backward_weights_into(
            record.split, {positions[k]: s.handle for k, s in into.items()}, assign=first)
        return [into[k] if k in into else None if p is None else by_position[p] for k, p in enumerate(positions)]

    def backward(self, record, received: dict, variables, sums: list | None = None):
        """The joint backward: (input gradients, weight gradients); ``sums`` as for
        ``backward_weights`` (a cut forward runs B, then W)."""
        if isinstance(record, _SplitTaped):
            d_inputs = self._split_inputs(record, received)
            return d_inputs, self.backward_weights(record, variables, sums)
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
