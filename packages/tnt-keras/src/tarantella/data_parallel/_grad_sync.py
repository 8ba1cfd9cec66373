"""Every optimizer update of a distributed model's weights applies the global gradient.

Keras optimizers apply gradients through ``Optimizer.apply`` (``apply_gradients`` calls
it). tnt wraps that one method, once per process, so that wherever a user's code applies
gradients to the variables of a model wrapped by ``tnt.Model`` on several ranks — a
custom ``train_step`` with one or several optimizers (a GAN), a custom training loop with
``tf.GradientTape`` — the gradients are first combined over the ranks:

    g = sum_r w_r g_r / sum_r w_r

with ``w_r`` the rank's micro-batch size ``b_r`` inside tnt's steps (the gradient of the
global mean loss when the step's loss is a per-sample mean: the serial result), the size
given to :func:`local_batch_size` in a custom loop, or 1 (the mean over ranks) otherwise.
Weights therefore stay identical on all ranks whatever the loop looks like; replicas
never drift apart silently.

With ``sharding=1|2`` (a model's own ``train_step``), the same weighted gradients are
allreduced (level 1) or reduce-scattered to their owners (level 2), and the optimizer
updates only the owned variables before their values are allgathered (``_sharded_apply``).

The default step reduces its gradients itself (fused with the metric states) and applies
them inside :func:`already_reduced`. Nested ``apply`` calls (``LossScaleOptimizer``
calling its inner optimizer) pass through: the outermost one reduced already, so the
loss-scale decision is the same on every rank.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import keras
import tensorflow as tf

from .._core import internals as _internals
from .._core import settings as _settings
from .._core import sparse as _sparse
from .._core.reducer import GraphReducer, Slot
from ._sharding import ShardingError

_state = threading.local()
_models: weakref.WeakValueDictionary[int, keras.Model] = weakref.WeakValueDictionary()
_wrappers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # inner model -> wrapper
_reducers: dict[tuple, GraphReducer] = {}
_installed = False


class UnsyncedReplicasError(RuntimeError):
    """Gradients would be applied before the replicas started from the same weights."""


@dataclass
class _Weighting:
    """How one scope weights this rank's gradients, and the reduction to order after."""

    weight: tf.Tensor | float | None  # None: the default step reduced already
    token: tf.Tensor | None = None


def _mode() -> _Weighting | None:
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def _pushed(mode: _Weighting) -> Iterator[_Weighting]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(mode)
    try:
        yield mode
    finally:
        stack.pop()


def step_scope(local_n: tf.Tensor, token: tf.Tensor) -> contextlib.AbstractContextManager[_Weighting]:
    """Inside tnt's step running a user's ``train_step``: weight by the micro-batch size."""
    return _pushed(_Weighting(tf.cast(local_n, tf.float32), token))


def already_reduced() -> contextlib.AbstractContextManager[_Weighting]:
    """Inside tnt's default step: the gradients given to ``apply`` are global already."""
    return _pushed(_Weighting(None))


def local_batch_size(n) -> contextlib.AbstractContextManager[_Weighting]:
    """Weight this rank's gradients by ``n`` samples in a custom training loop.

    With micro-batches of different sizes (global batch not divisible by the number of
    ranks, a smaller last batch), a per-sample-mean loss on ``n`` local samples gives
    the serial gradient when each rank's gradient counts ``n / sum(n)``::

        with tnt.local_batch_size(tf.shape(x)[0]):
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

    Without it, ``apply_gradients`` takes the plain mean over ranks (exact when every
    rank's micro-batch has the same size).
    """
    return _pushed(_Weighting(tf.cast(n, tf.float32)))


def register(model: keras.Model, wrapper) -> None:
    """Mark ``model``'s variables as distributed; ``wrapper`` tells whether it is synced."""
    _install()
    _models[id(model)] = model
    _wrappers[model] = wrapper


def _owner(variables) -> keras.Model | None:
    """The registered model owning any of ``variables`` (compared by identity)."""
    ids = {id(v) for v in variables}
    for model in list(_models.values()):
        if any(id(v) in ids for v in model.variables):
            return model
    return None


def _install() -> None:
    """Wrap ``apply`` of Keras' optimizer base class and of LossScaleOptimizer, once."""
    global _installed
    if _installed:
        return
    for cls in (keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer):
        cls.apply = _distributed_apply(cls.apply)
    _installed = True


def _distributed_apply(original):
    def apply(self, grads, trainable_variables=None):
        mode = _mode()
        if getattr(_state, "inside", False) or (mode is not None and mode.weight is None):
            return original(self, grads, trainable_variables)
        variables = list(trainable_variables) if trainable_variables is not None else (
            _internals.optimizer_variables_built_on(self))
        from .._core import runtime as _runtime

        owner = _owner(variables) if _runtime.get_size() > 1 else None
        if owner is None or len(grads) == 0:
            return original(self, grads, trainable_variables)
        _check_synced(owner)
        sharding = getattr(_wrappers.get(owner), "_tnt_sharding", None)
        _state.inside = True
        try:
            if sharding is not None:
                return _sharded_apply(self, sharding, list(grads), trainable_variables, mode)
            global_grads, _ = _global_gradients(list(grads), variables, mode)
            return original(self, global_grads, trainable_variables)
        finally:
            _state.inside = False

    apply.__doc__ = original.__doc__
    return apply


def _sharded_apply(optimizer, sharding, grads: list, trainable_variables, mode: _Weighting | None) -> None:
    """``sharding=1|2`` in a user's own step: the optimizer updates only the variables this
    replica owns of those it is given (its own ownership, ``Sharding.for_optimizer``), from
    the global gradients (level 1: allreduced; level 2: reduce-scattered to their owners),
    then the owners' new values are allgathered (``Sharding.apply``, as tnt's default step)."""
    if trainable_variables is None:
        raise ShardingError(
            f"tnt.Model(sharding={sharding.level}): optimizer.apply(grads) without the variables; each "
            "optimizer's slots are built on the variables a replica owns, so pass them: "
            "optimizer.apply_gradients(zip(grads, variables)) or apply(grads, variables), or use sharding=0.")
    variables = list(trainable_variables)
    shards = sharding.for_optimizer(optimizer, variables)
    scatter = shards.reduce_scatter if sharding.level >= 2 else None
    global_grads, done = _global_gradients(grads, variables, mode, scatter)
    token = shards.apply(optimizer, global_grads, variables, after=done)
    if mode is not None:
        mode.token = token
    else:
        _state.token = token


# Note [Float16 overflow as serial]
# Under mixed_float16, serial Keras differentiates an autocast variable through a float16
# cast: the gradient over the whole batch is a float16 value, inf beyond 65504, and the
# LossScaleOptimizer then skips the step and halves the scale. A rank's part covers fewer
# samples and tnt sums the parts in float32, so the global gradient can exceed float16's
# range and stay finite: tnt would apply a step serial Keras skips (reproduced on 2 ranks,
# docs/keras.md). So, in tnt's default step and for the LossScaleOptimizer only, a global
# gradient of such a variable that does not fit float16 is made inf: the optimizer takes
# serial Keras' decision. (The converse, a rank's part overflowing where the whole sum
# cancels to a finite value, is a decision no sum can undo; docs/keras.md says so.) A
# custom train_step or loop differentiates each rank's own mean loss, whose gradient has
# the serial magnitude; their weighted mean over ranks always fits float16 when every part
# does. One pass over those gradients per step, only with loss scaling on several ranks.
def overflow_as_serial(model: keras.Model, grads: list) -> list:
    """``model``'s global gradients (one per trainable variable), with those serial Keras
    would hold in float16 made inf where they overflow it (with a LossScaleOptimizer)."""
    if not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        return grads
    in_float16 = _internals.float16_differentiated(model)
    out = []
    for g, v in zip(grads, model.trainable_variables):
        if g is not None and id(v) in in_float16 and isinstance(g, tf.Tensor):
            fits = tf.reduce_all(tf.math.is_finite(tf.cast(g, tf.float16)))
            g = g + tf.where(fits, tf.zeros((), g.dtype), tf.constant(float("inf"), g.dtype))
        out.append(g)
    return out


def _check_synced(model: keras.Model) -> None:
    wrapper = _wrappers.get(model)
    if wrapper is not None and not wrapper._tnt_weights_synced:
        raise UnsyncedReplicasError(
            "tnt.Model: gradients are applied before the replicas were made identical "
            "(weights are broadcast from rank 0 when a built model is wrapped, or at the "
            "first fit/evaluate/predict). Build the Keras model before wrapping it "
            "(start it with keras.Input(...) or call model.build(input_shape)), or call "
            "the tnt.Model once on a batch outside tf.function before the training loop."
        )


def _chain_token(mode: _Weighting | None) -> tf.Tensor | None:
    """The previous reduction of this graph, so reductions start in program order."""
    token = mode.token if mode is not None else getattr(_state, "token", None)
    if token is None or tf.executing_eagerly():
        return None
    return token if getattr(token, "graph", None) is tf.compat.v1.get_default_graph() else None


def _reducer(slots: list[Slot]) -> GraphReducer:
    """The process's reducer of these slots (one per distinct list: its buffers are kept)."""
    from .._core import runtime as _runtime

    key = tuple((s.name, s.shape, s.dtype.name) for s in slots)
    reducer = _reducers.get(key)
    if reducer is None:
        reducer = _reducers[key] = GraphReducer(slots, _runtime.fusion_threshold_bytes())
    return reducer


def _global_gradients(grads: list, variables: list, mode: _Weighting | None,
                      scatter=None) -> tuple[list, list[tf.Tensor]]:
    """The ``w_r``-weighted mean over ranks of each gradient, and the tokens of the last
    collectives. ``scatter`` (level 2: ``Sharding.reduce_scatter``): the dense ones are summed
    only on their owners (None elsewhere); the weights are allreduced."""
    if _settings.sparse_as_dense():
        grads = [None if g is None else _sparse.to_dense(g) for g in grads]
    # Sparse gradients (IndexedSlices) are gathered after the reduction, in rank order
    # (Note [Sparse gradients as serial]); the others are SUM-reduced.
    present = [i for i, g in enumerate(grads) if g is not None and not _sparse.is_sparse(g)]
    sparse_at = [i for i, g in enumerate(grads) if _sparse.is_sparse(g)]
    weight = tf.constant(1.0) if mode is None else mode.weight
    has_data = weight > 0
    # Note [Weights first]: the weights' sum is reduced on its own, before the gradients, so
    # each rank scales its gradient by its share w_r / sum w (at most 1). Scaled by w_r itself
    # and divided after the sum, a loss-scaled gradient that fits float32 (as serial Keras'
    # does) could overflow on the way and make the LossScaleOptimizer skip a step serial
    # Keras applies (2 of 8 steps at scale 2^127 on 2 ranks, before).
    total = _reducer([Slot("weight", (1,), tf.float32)]).reduce([tf.reshape(weight, [1])],
                                                                start=_chain_token(mode))[0][0]
    share = tf.where(has_data, weight / tf.maximum(total, 1e-30), 0.0)
    weighted = []
    for i in present:
        g = tf.convert_to_tensor(grads[i])
        weighted.append(tf.where(has_data, g * tf.cast(share, g.dtype), tf.zeros_like(g)))
    done = [total]
    out = list(grads)
    summed: dict = {}
    if scatter is None and present:
        slots = [Slot(f"grad:{variables[i].path}", tuple(int(d) for d in variables[i].shape),
                      tf.as_dtype(weighted[k].dtype)) for k, i in enumerate(present)]
        reduced = _reducer(slots).reduce(weighted, start=total)
        summed = dict(zip(present, reduced))
        done = [reduced[-1]]
    for i in sparse_at:
        mine = _sparse.keep_rows_if(_sparse.scale(grads[i], share), has_data)
        out[i] = _sparse.allgather(mine, after=done)
        done = [out[i].values]
    if scatter is not None:  # after the sparse gathers, in the same order on every rank
        # The static shape: the scatter's sizes are counted from it (a Dense on a 3-D input).
        dense = {i: tf.ensure_shape(g, variables[i].shape) for i, g in zip(present, weighted)}
        summed, scattered = scatter(dense, has_data, done)
        done = scattered or done
    if mode is not None:
        mode.token = done[-1]
    else:
        _state.token = done[-1]
    for i in present:
        out[i] = summed.get(i)
    return out, done
