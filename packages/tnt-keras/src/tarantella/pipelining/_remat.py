"""Stage recomputation (``remat="stages"``): keep a micro-batch's inputs, not its activations.

Note [Stage recomputation]
A stage's forward normally runs under a ``tf.GradientTape`` that keeps every activation of
the micro-batch alive until its backward pass; a 1F1B stage holds up to p - s such sets,
GPipe m. With ``remat="stages"`` the forward runs without a tape (its outputs are sent on,
its activations freed at once) and the executor keeps only the micro-batch's inputs; its
backward pass first re-runs the forward under a tape, then differentiates as before. So
activations cost one micro-batch's set at a time, plus the inputs of those in flight, at
the price of a second forward pass per micro-batch.

The re-run must compute exactly what the first forward computed and leave no trace:
- it starts from the state the first forward met: the stage's non-trainable variables
  (dropout's seed generator state, batch normalisation's moving statistics) are set to
  their values before that forward (so dropout draws the same mask);
- it ends where the model was: every state variable and metric variable is set back to its
  value before the re-run (the re-run's moving-statistics updates and loss-metric updates
  are the first forward's, already applied).
A snapshot is a copy (a read of a TensorFlow variable may share its buffer, which an
in-place update such as batch normalisation's then changes); after the first re-run only
the variables a forward changes are copied and restored, so frozen weights are copied in
the first step only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from .._core.errors import PipelineError

#: The one recomputation granularity built: each pipeline stage as a whole.
STAGES = "stages"
CHOICES = (None, STAGES)


def check_remat(remat) -> str | None:
    """``remat`` as given, or a clear error (the choices and what each does)."""
    if remat not in CHOICES:
        raise PipelineError(
            f"remat={remat!r} is not supported: use remat='stages' (each pipeline stage recomputes its "
            "activations in the backward pass, keeping only its inputs per micro-batch in flight) or "
            "remat=None (keep activations). For recomputation inside chosen layers, build the model under "
            "keras.RematScope, which every strategy runs as serial Keras does.")
    return remat


@dataclass
class Recompute:
    """What a forward without a tape keeps for its backward pass."""

    inputs: list
    y: object
    sample_weight: object
    weight: object
    state: dict  # id(variable) -> its value before the forward


class StageState:
    """The variables a stage's forward may change (non-trainable and metric variables)."""

    def __init__(self, model) -> None:
        self._model = model
        self._changed: set[int] | None = None  # ids the first re-run changed (None: not known yet)

    def _variables(self) -> list:
        seen, out = set(), []
        for v in (*self._model.non_trainable_variables, *self._model.metrics_variables):
            if id(v) not in seen and (self._changed is None or id(v) in self._changed):
                seen.add(id(v))
                out.append(v)
        return out

    def snapshot(self) -> dict:
        """Copies of the values now."""
        return {id(v): np.array(v.value, copy=True) for v in self._variables()}

    @contextlib.contextmanager
    def restored(self, before: dict):
        """Run the body from the state ``before``, then put back the state of now."""
        variables = self._variables()
        now = self.snapshot()
        for v in variables:
            if id(v) in before:
                v.assign(before[id(v)])
        try:
            yield
        finally:
            if self._changed is None:  # once: which variables a forward changes (from `before`)
                self._changed = {id(v) for v in variables if id(v) not in before  # made by a forward
                                 or not np.array_equal(np.asarray(v.value), np.asarray(before[id(v)]))}
            for v in variables:
                v.assign(now[id(v)])
