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
the cost per micro-batch (the slope) and per step (the intercept). The estimate charges
``step + (m + p - 1) * (slowest stage's layers + per micro-batch)``.
"""

from __future__ import annotations

import functools
import statistics
import time

import keras
import numpy as np

_MICRO_BATCHES = 4
_ROWS = 2
_WARM, _TIMED = 2, 9


def _probe(micro_batches: int):
    """A warmed-up training step of the probe pipeline at ``micro_batches``, as a callable."""
    from ..pipelining import LocalPipeline

    # named and zero-initialised: the probe draws no auto-generated name and no random number
    # the user's next model would have drawn
    def dense(units: int, name: str):
        return keras.layers.Dense(units, kernel_initializer="zeros", name=f"tnt_probe_{name}")

    inp = keras.Input((4,), name="tnt_probe_input")
    model = keras.Model(inp, dense(2, "c")(dense(4, "b")(dense(4, "a")(inp))), name="tnt_pipeline_probe")
    pipe = LocalPipeline(model, 1, num_micro_batches=micro_batches)
    pipe.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x_data = np.zeros((_ROWS * micro_batches, 4), np.float32)
    y_data = np.zeros(_ROWS * micro_batches, np.int32)
    for _ in range(_WARM):
        pipe.train_step(x_data, y_data)
    return lambda: pipe.train_step(x_data, y_data)


@functools.cache
def measure() -> tuple[float, float]:
    """(seconds per step, seconds per micro-batch) of the executor's own work; (0, 0) when
    the probe cannot run (the estimate then counts two function calls per micro-batch).
    A property of the machine and process, not of the model: measured once per process."""
    try:
        steps = {m: _probe(m) for m in (1, _MICRO_BATCHES)}
    except Exception:  # no overhead term rather than no plan
        return 0.0, 0.0
    times: dict[int, list[float]] = {m: [] for m in steps}
    for _ in range(_TIMED):  # alternating: both see the same moments of a busy machine
        for m, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[m].append(time.perf_counter() - t0)
    one, many = (statistics.median(times[m]) for m in (1, _MICRO_BATCHES))
    per_micro_batch = max(many - one, 0.0) / (_MICRO_BATCHES - 1)
    return max(one - per_micro_batch, 0.0), per_micro_batch
