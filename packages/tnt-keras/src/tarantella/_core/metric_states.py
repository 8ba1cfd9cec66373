"""Global metric states: what one step adds to each metric, summed over the ranks.

Around a step, every metric's state variables are read (``before``), reset, and read
again (``initial``); what the step adds on this rank is ``value - initial``. Summed over
ranks and added to ``before``, that is the state serial Keras reaches on the global batch.

Two kinds of update need two rules (Note [Per-step updates]):

- *per-sample* updates (``update_state(y_true, y_pred)``, or values with a batch
  dimension, or a tensor sample weight such as the default step's loss tracker weighted
  by the micro-batch size): the ranks' contributions are simply summed;
- *per-step* updates: one scalar per step with no or a Python-number sample weight — a
  custom step's ``loss_tracker.update_state(loss)``, and Keras' per-output loss metrics,
  which pass the static batch dimension (``None`` when unknown). Serial Keras adds one
  global-batch value per step, so the ranks' contributions are combined with weights
  ``b_r / B``: the global mean of a per-sample mean, and a count that grows by one.

The kind is decided while the step is traced, by watching each metric's ``update_state``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import tensorflow as tf


def metric_variables(model: keras.Model) -> list[keras.Variable]:
    """All state variables of the model's metrics, each once, in a rank-independent order."""
    return [v for _, v in _owned_variables(model)]


def _owned_variables(model: keras.Model) -> list[tuple[keras.metrics.Metric, keras.Variable]]:
    seen: set[int] = set()
    out = []
    for metric in model.metrics:
        for var in metric.variables:
            if id(var) not in seen:
                seen.add(id(var))
                out.append((metric, var))
    return out


def _is_scalar(value) -> bool:
    if isinstance(value, int | float):
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) == 0


def _is_per_step(metric: keras.metrics.Metric, args: tuple, kwargs: dict) -> bool:
    """Note [Per-step updates]: a Mean/Sum fed one scalar, weight absent or a Python number."""
    if not isinstance(metric, keras.metrics.Mean | keras.metrics.Sum) or isinstance(
        metric, keras.metrics.MeanMetricWrapper
    ):
        return False
    values = args[0] if args else kwargs.get("values")
    weight = args[1] if len(args) > 1 else kwargs.get("sample_weight")
    return _is_scalar(values) and (weight is None or isinstance(weight, int | float))


class MetricExchange:
    """Reads, resets and merges the model's metric states around one (traced) step.

    Functional, because the parts before and after the exchange are separate graphs:
    :meth:`begin` returns what :meth:`contributions` needs, which returns the states
    before the step (aligned with the variables that exist after it) for :meth:`finish`.
    """

    def __init__(self, model: keras.Model) -> None:
        self._model = model
        self._per_step: set[int] = set()  # id() of metrics seen with per-step updates
        self._results: dict[int, tuple[keras.metrics.Metric, int]] = {}

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """While tracing the code inside: note per-step updates and returned results."""
        metrics = list(self._model.metrics)
        for metric in metrics:
            update, result = metric.update_state, metric.result

            def watched_update(*args, _metric=metric, _update=update, **kwargs):
                if _is_per_step(_metric, args, kwargs):
                    self._per_step.add(id(_metric))
                return _update(*args, **kwargs)

            def watched_result(*args, _metric=metric, _result=result, **kwargs):
                value = _result(*args, **kwargs)
                for k, leaf in enumerate(tf.nest.flatten(value)):
                    self._results[id(leaf)] = (_metric, k)
                return value

            object.__setattr__(metric, "update_state", watched_update)
            object.__setattr__(metric, "result", watched_result)
        try:
            yield
        finally:
            for metric in metrics:
                for name in ("update_state", "result"):
                    with contextlib.suppress(AttributeError):
                        object.__delattr__(metric, name)

    def begin(self, data_ready: tf.Tensor) -> dict[int, tuple[tf.Tensor, tf.Tensor]]:
        """Each state's value before the step, then reset: ``{id(var): (before, initial)}``.

        ``data_ready``: a tensor computed from the step's input. The reads and resets wait
        for it: they depend on no data otherwise, and in a graph they would also run in
        the call Keras makes past the last batch of a dataset of unknown length (which
        fails in ``get_next``), leaving every metric reset — logs of 0.
        """
        variables = metric_variables(self._model)
        with tf.control_dependencies([data_ready]):
            before = {id(v): tf.identity(v.value) for v in variables}
        with tf.control_dependencies(list(before.values())):
            for metric in self._model.metrics:
                metric.reset_state()
        return {id(v): (before[id(v)], tf.identity(v.value)) for v in variables}

    def contributions(self, begun: dict, local_n: tf.Tensor, has_data: tf.Tensor) -> tuple[list, list]:
        """(states before the step, this rank's contributions), one per metric variable.

        Per-step contributions are already multiplied by ``b_r``. A variable created
        during the step (a metric built by its first update) started from its reset
        value, zero for Keras' metrics.
        """
        before, out = [], []
        for metric, var in _owned_variables(self._model):
            if id(var) in begun:
                prior, start = begun[id(var)]
                value = var.value - start
            else:
                prior, value = tf.zeros_like(var.value), tf.convert_to_tensor(var.value)
            if id(metric) in self._per_step and value.dtype.is_floating:
                value = value * tf.cast(local_n, value.dtype)
            before.append(prior)
            out.append(tf.where(has_data, value, tf.zeros_like(value)))
        return before, out

    def finish(self, before: list, summed: list, global_n: tf.Tensor) -> list[tf.Tensor]:
        """Set every state to its value before the step plus the summed contributions."""
        done = []
        for (metric, var), prior, total in zip(_owned_variables(self._model), before, summed):
            dtype = tf.as_dtype(var.dtype)
            total = tf.cast(total, dtype)
            if id(metric) in self._per_step and dtype.is_floating:
                total = total / tf.cast(tf.maximum(global_n, 1), dtype)
            var.assign(prior + total)
            done.append(var.value)
        return done

    def result_of(self, leaf) -> tuple[keras.metrics.Metric, int] | None:
        """(metric, index in its flattened result) when ``leaf`` is a watched result."""
        return self._results.get(id(leaf))
