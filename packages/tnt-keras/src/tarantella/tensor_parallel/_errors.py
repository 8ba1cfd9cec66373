"""The error a tensor-parallel model raises for input it cannot honour."""

from __future__ import annotations


class TensorParallelError(ValueError):
    """A model, plan or option that ParallelStrategy.TENSOR cannot run; the message names the fix."""
