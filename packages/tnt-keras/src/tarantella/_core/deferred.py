"""Models whose variables have shapes but no values, so that no rank materialises them all.

A layer built inside :func:`deferred_variables` (a Keras ``StatelessScope`` that does not
initialise on exit) gets variables that know their shape, dtype and initializer but hold
no memory. Pipelining builds the plan from such a model (it needs shapes only), and each
rank then creates real variables for its own stage's layers only: their values come from
the original variables' initializers (the same values an eagerly built model gets, since
Keras fixes an initializer's seed when the layer is made) or, when loading, from the
stage's part of the file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras

from . import internals as _internals


@contextlib.contextmanager
def deferred_variables() -> Iterator[None]:
    """Build Keras models inside this block without allocating their variables.

        with tnt.pipelining.deferred_variables():
            keras_model = build_model()        # shapes only, no memory for weights
        model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.PIPELINING, ...)

    Pipelining and tensor parallelism materialise each rank's part only; so does
    ``tnt.Model(..., sharding=3)`` (each replica its owned per-layer variables and those kept
    whole). Other DATA models, one rank and one stage materialise it whole (:func:`materialise`).
    """
    before = len(_internals.uninitialized_pending())
    try:
        # Optimizers (a model that compiles itself in its constructor) are made whole.
        with keras.StatelessScope(initialize_variables=False), _internals.optimizers_made_with_values():
            yield
    finally:
        # Keras would initialise them at the end of its next symbolic call's scope.
        _internals.forget_uninitialized(_internals.uninitialized_pending()[before:])


def is_deferred(variable) -> bool:
    """True for a variable made in :func:`deferred_variables` and never given a value."""
    return _internals.is_uninitialized(variable)


def current_or_initial(variable):
    """The variable's value, or for a deferred variable the value it would be given."""
    return _internals.initial_value(variable) if is_deferred(variable) else variable.value


def _variables(model: keras.Model) -> list:
    optimizer = getattr(model, "optimizer", None)
    return list(model.variables) + (list(optimizer.variables) if optimizer is not None else [])


def has_deferred(model: keras.Model) -> bool:
    """Whether ``model`` (or its optimizer) holds a deferred variable."""
    return any(is_deferred(v) for v in _variables(model))


def materialise(model: keras.Model) -> None:
    """Give every deferred variable of ``model`` its initial value (the one-rank path)."""
    for v in _variables(model):
        if is_deferred(v):
            _internals.initialize_deferred(v)
