"""The errors of a layout or model that a strategy cannot run; each message names the fix.

They live in the core because the mesh, the strategy registry and the file code raise
them for every strategy; ``tnt.pipelining`` and ``tnt.tensor_parallel`` export them.
"""

from __future__ import annotations


class PipelineError(ValueError):
    """The model, plan or pipeline setting cannot run as given; the message names the fix."""


class TensorParallelError(ValueError):
    """A model, plan or option that ParallelStrategy.TENSOR cannot run; the message names the fix."""


class InputError(ValueError):
    """The input given to fit/evaluate/predict cannot be distributed as given."""
