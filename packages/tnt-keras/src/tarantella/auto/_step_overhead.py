"""A Keras training step's own cost on this machine: what a step of a model whose layers
cost nothing takes.

Note [A step's own cost]
Beside its layers' forward and backward and the optimizer's update, every step of
``fit`` pays for the loop around it: the callbacks' hooks, taking the batch from the
iterator, calling the traced step function and reading back its logs. The profile's layer
times are net of one timed call (Note [Layers timed as their model calls them]), so without
this a layout without stages was predicted 20-30 % under its measured step on the 2-core
machine (a tiny model's step there: 1.1-1.7 ms, an empty timed call 0.3-0.4 ms). It is
measured on serial Keras, ``fit`` of three tiny zero-initialised Dense layers with Adam
(their update's own price taken off, as the estimate adds every layout's update), timed
between the batch hooks as ``benchmarks/auto.py`` times the layouts' steps.
"""

from __future__ import annotations

import functools
import statistics
import time

import keras
import numpy as np

_LAYERS = 3
_ROWS = 2
_WARM, _TIMED = 4, 15


@functools.cache
def measure(update_s_per_variable: float = 0.0) -> float:
    """Seconds of the probe's training step beyond its update (``update_s_per_variable``
    per variable), the median of ``_TIMED`` steps; 0 when the probe cannot run."""
    times: list[float] = []

    class _Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self._t0)

    try:
        # named and zero-initialised, unshuffled: the probe draws no auto-generated name and no
        # random number the user's next model would have drawn
        inp = keras.Input((4,), name="tnt_step_probe_input")
        x = inp
        for k in range(_LAYERS):
            x = keras.layers.Dense(4, kernel_initializer="zeros", name=f"tnt_step_probe_{k}")(x)
        model = keras.Model(inp, x, name="tnt_step_probe")
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        steps = _WARM + _TIMED
        data = np.zeros((_ROWS * steps, 4), np.float32), np.zeros(_ROWS * steps, np.int32)
        model.fit(*data, batch_size=_ROWS, shuffle=False, verbose=0, callbacks=[_Timer()])
    except Exception:  # no step term rather than no plan
        return 0.0
    return max(statistics.median(times[_WARM:]) - 2 * _LAYERS * update_s_per_variable, 0.0)
