"""What ``compile`` means for a model class with a compile of its own, in every layout.

keras-hub's tasks (``GPT2CausalLM``, ...) override ``compile`` to fill in defaults: a loss,
an optimizer and a weighted ``sparse_categorical_accuracy``. The data-parallel wrapper
compiles the user's model itself, so those defaults apply; the layouts that compile
something else (a stage, a model of shards) must ask the model's own ``compile`` first,
or a compiled metric goes missing from History. This module asks it, once for all.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import keras

from . import internals as _internals


def own_compile_arguments(model_class: type, make_model: Callable[[], keras.Model], args: tuple,
                          kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``keras.Model.compile`` (all of them, by name) that a model of
    ``model_class`` passes on when its ``compile(*args, **kwargs)`` runs.

    A class keeping Keras' compile: ``args``/``kwargs`` bound to its signature. A class
    with its own: its compile runs on ``make_model()`` (a model only used for this, e.g.
    one with deferred variables) and what reached ``keras.Model.compile`` is read back.
    """
    signature = inspect.signature(keras.Model.compile)
    if getattr(model_class, "compile", None) is keras.Model.compile:
        bound = signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        out = dict(bound.arguments)
        out.pop("self")
        return out
    try:
        model = _empty_model_of(model_class)
        model.compile(*args, **kwargs)
    except Exception:  # a compile that reads what the class's __init__ set: the real thing
        model = make_model()
        model.compile(*args, **kwargs)
    out = _internals.compile_arguments(model)
    # What Keras does not record: its default, or the caller's choice.
    out.setdefault("auto_scale_loss", kwargs.get("auto_scale_loss", True))
    return {name: out[name] for name in signature.parameters if name != "self" and name in out}


def _empty_model_of(model_class: type) -> keras.Model:
    """A model of ``model_class`` without its layers (its ``__init__`` skipped): enough to
    run its ``compile``, never the whole model. keras-hub's tasks compile themselves in
    ``__init__`` with a fresh optimizer, which a deferred build cannot create (Keras makes
    no variable with a value inside a stateless scope)."""

    def empty_init(self) -> None:
        keras.Model.__init__(self)

    probe_class = type(f"CompileProbe{model_class.__name__}", (model_class,), {"__init__": empty_init})
    return probe_class()


__all__ = ["own_compile_arguments"]
