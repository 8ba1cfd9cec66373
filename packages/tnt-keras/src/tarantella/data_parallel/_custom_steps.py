"""A wrapped model's own ``train_step``/``test_step``/``predict_step``, run on N ranks.

The user's step runs unchanged on this rank's micro-batch (``b_r`` samples of the
global batch ``B``). Three things make its result the serial one:

1. Every optimizer update it makes (``optimizer.apply_gradients``/``apply``, one or
   several optimizers) applies the ``b_r``-weighted mean of the ranks' gradients
   (``_grad_sync.step_scope``): the gradient of the global loss when the step's loss is
   a per-sample mean, as Keras' losses are.
2. The metric and tracker states it updates are merged over ranks
   (``_metric_states``): summed for per-sample updates, ``b_r/B``-weighted for one
   scalar per step (``tracker.update_state(loss)``).
3. Its returned logs are re-read after the merge: a value that came from a metric's
   ``result()`` is that metric's global result; any other float value is replaced by
   the ``b_r/B``-weighted mean over ranks (a batch mean of the global batch).

What cannot be made serial from outside the step: random draws inside it (each rank
draws for its own samples — feed noise through the data to reproduce serial), and
arithmetic on the local batch size (``tf.shape(x)[0]`` is ``b_r``, not ``B``). Weights
stay identical on all ranks in every case. See docs/keras.md, "Custom train_step".
"""

from __future__ import annotations

import keras
import tensorflow as tf

from .._core.batch_norm import valid_rows
from .._core.metric_states import MetricExchange, metric_variables
from .._core.reducer import GraphReducer, Slot, start_token
from .._core.step_parts import allgather_rows, nonempty
from . import _grad_sync


def _first_rows(data) -> tf.Tensor:
    first = next(t for t in tf.nest.flatten(data) if t is not None)
    return tf.shape(first)[0]


class CustomSteps:
    """Runs the user's steps; one metric exchange and reducer per kind of step."""

    def __init__(self, model: keras.Model, threshold_bytes: int) -> None:
        self._model = model
        self._threshold = threshold_bytes
        self._exchanges = {"train": MetricExchange(model), "test": MetricExchange(model)}
        self._reducers: dict[tuple, GraphReducer] = {}

    def close(self) -> None:
        for reducer in self._reducers.values():
            reducer.close()
        self._reducers.clear()

    def train_step(self, data, size: int):
        if size == 1:
            return self._model.train_step(data)
        return self._run("train", self._model.train_step, data)

    def test_step(self, data, size: int):
        if size == 1:
            return self._model.test_step(data)
        return self._run("test", self._model.test_step, data)

    def predict_step(self, data, size: int):
        if size == 1:
            return self._model.predict_step(data)

        local_n = _first_rows(data)
        out = self._model.predict_step(nonempty(data, local_n))
        return tf.nest.map_structure(lambda t: allgather_rows(t[:local_n]), out)

    # -- the shared protocol ------------------------------------------------------------
    def _run(self, kind: str, step, data):

        exchange = self._exchanges[kind]
        local_n = _first_rows(data)
        has_data = local_n > 0
        data = nonempty(data, local_n)
        begun = exchange.begin(tf.nest.flatten(data)[0])
        with exchange.watch(), valid_rows(local_n), _grad_sync.step_scope(local_n, start_token()) as scope:
            logs = step(data)
        before, contribution = exchange.contributions(begun, local_n, has_data)
        leaves = tf.nest.flatten(logs)
        own = [i for i, leaf in enumerate(leaves)
               if exchange.result_of(leaf) is None and _is_float_tensor(leaf)]
        b = tf.cast(local_n, tf.float32)
        log_values = [tf.where(has_data, tf.cast(leaves[i], tf.float32) * b, 0.0) for i in own]
        values = [tf.reshape(b, [1]), *contribution, *(tf.reshape(v, [-1]) for v in log_values)]
        reducer = self._reducer(kind, values)
        reduced = reducer.reduce(values, start=scope.token)
        global_n = reduced[0][0]
        done = exchange.finish(before, reduced[1 : 1 + len(contribution)], global_n)
        with tf.control_dependencies(done):
            return self._global_logs(logs, leaves, own, reduced[1 + len(contribution):],
                                     global_n, exchange)

    def _reducer(self, kind: str, values: list) -> GraphReducer:
        names = ["batch_size"] + [f"metric:{v.path}" for v in metric_variables(self._model)]
        names += [f"log:{i}" for i in range(len(values) - len(names))]
        slots = [Slot(n, tuple(int(d) for d in v.shape), v.dtype) for n, v in zip(names, values)]
        key = (kind, *((s.name, s.shape, s.dtype.name) for s in slots))
        if key not in self._reducers:
            self._reducers[key] = GraphReducer(slots, self._threshold)
        return self._reducers[key]

    @staticmethod
    def _global_logs(logs, leaves, own, reduced_logs, global_n, exchange: MetricExchange):
        out = list(leaves)
        fresh: dict[int, list] = {}
        for i, leaf in enumerate(leaves):
            found = exchange.result_of(leaf)
            if found is None:
                continue
            metric, k = found
            if id(metric) not in fresh:
                fresh[id(metric)] = tf.nest.flatten(metric.result())
            out[i] = fresh[id(metric)][k]
        for i, value in zip(own, reduced_logs):
            mean = tf.reshape(value, tf.shape(leaves[i])) / tf.maximum(global_n, 1.0)
            out[i] = tf.cast(mean, leaves[i].dtype)
        return tf.nest.pack_sequence_as(logs, out)


def _is_float_tensor(value) -> bool:
    return tf.is_tensor(value) and value.dtype.is_floating
