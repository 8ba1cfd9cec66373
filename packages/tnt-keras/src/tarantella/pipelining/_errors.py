"""The one exception class of pipelining: a model or setting that cannot be pipelined."""

from __future__ import annotations


class PipelineError(ValueError):
    """The model, plan or pipeline setting cannot run as given; the message names the fix."""
