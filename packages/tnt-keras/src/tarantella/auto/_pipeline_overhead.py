"""The pipeline executor's own cost per step and per micro-batch, measured on this machine.

Note [The pipeline's own cost]
A pipeline stage does more than its layers' forward and backward: per micro-batch the
executor calls a forward and a backward function under a tape, hands tensors to and from
numpy and sums the gradients; per step it splits the batch, runs the loss and finiteness
checks and the stage's end-of-step code. On a small model this is most of the step: on the
2-core machine, a 2-stage MLP (0.5 M parameters, 8 rows per micro-batch) spent 7.5 ms of its
26 ms step outside the schedule and 3.6 ms per micro-batch where its layers take 2.3, and the
planner predicted 11.5 ms. Both are measured here on a one-stage ``LocalPipeline`` (the same
executor and end-of-step code as a launched stage, in this process) of a three-layer model
whose layers cost next to nothing: its step at 1 and at ``_MICRO_BATCHES`` micro-batches gives
the cost per micro-batch (the slope) and per step (the intercept); a second probe of 12 layers
at one micro-batch gives the cost per trainable variable and step (each gradient sum is a
variable made and released per step, and its update runs apart: 0.28 ms per variable on the
2-core machine, where DATA's fused update costs 0.03). The estimate charges ``step +
variables * per variable + (m + p - 1) * (slowest stage's layers + per micro-batch)``, the
variables of the stage with the most (with its update's bytes).
"""

from __future__ import annotations

import functools
import statistics
import time

import keras
import numpy as np

_MICRO_BATCHES = 4
#: Probe sizes (tiny Dense layers, a kernel and a bias each): the slope gives the per-variable cost.
_LAYERS = (3, 12)
_ROWS = 2
_WARM, _TIMED = 2, 9


def _probe(layers: int, micro_batches: int):
    """A warmed-up training step of a probe pipeline of ``layers`` tiny Dense layers at
    ``micro_batches``, as a callable."""
    from ..pipelining import LocalPipeline

    # named and zero-initialised: the probe draws no auto-generated name and no random number
    # the user's next model would have drawn
    def dense(units: int, name: str):
        return keras.layers.Dense(units, kernel_initializer="zeros", name=f"tnt_probe_{name}")

    inp = keras.Input((4,), name="tnt_probe_input")
    x = inp
    for k in range(layers):
        x = dense(4, str(k))(x)
    model = keras.Model(inp, x, name="tnt_pipeline_probe")
    pipe = LocalPipeline(model, 1, num_micro_batches=micro_batches)
    pipe.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x_data = np.zeros((_ROWS * micro_batches, 4), np.float32)
    y_data = np.zeros(_ROWS * micro_batches, np.int32)
    for _ in range(_WARM):
        pipe.train_step(x_data, y_data)
    return lambda: pipe.train_step(x_data, y_data)


@functools.cache
def measure() -> tuple[float, float, float]:
    """(seconds per step, per micro-batch, per trainable variable and step) of the executor's
    own work; zeros when the probe cannot run (the estimate then counts two function calls per
    micro-batch). A property of the machine and process, not of the model: measured once per
    process."""
    few, many = _LAYERS
    shapes = [(few, 1), (few, _MICRO_BATCHES), (many, 1)]
    try:
        steps = {shape: _probe(*shape) for shape in shapes}
    except Exception:  # no overhead term rather than no plan
        return 0.0, 0.0, 0.0
    times: dict[tuple, list[float]] = {shape: [] for shape in steps}
    for _ in range(_TIMED):  # alternating: all see the same moments of a busy machine
        for shape, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[shape].append(time.perf_counter() - t0)
    median = {shape: statistics.median(t) for shape, t in times.items()}
    per_micro_batch = max(median[(few, _MICRO_BATCHES)] - median[(few, 1)], 0.0) / (_MICRO_BATCHES - 1)
    per_variable = max(median[(many, 1)] - median[(few, 1)], 0.0) / (2 * (many - few))  # kernel + bias
    per_step = max(median[(few, 1)] - per_micro_batch - 2 * few * per_variable, 0.0)
    return per_step, per_micro_batch, per_variable
