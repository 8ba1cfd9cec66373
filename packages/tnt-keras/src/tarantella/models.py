"""``tnt.models``: Keras' model functions, returning ``tnt.Model``s.

Files are plain Keras 3 files (``.keras`` for whole models); the master rank reads them
and shares the bytes, so every rank loads the same model even without a shared disk.
"""

from __future__ import annotations

import json
from typing import Any

import keras

from . import _io
from ._model import Model, ParallelStrategy

__all__ = ["clone_model", "load_model", "model_from_config", "model_from_json", "save_model"]


def _inner(model) -> keras.Model:
    return model.model if isinstance(model, Model) else model


def load_model(filepath, custom_objects=None, compile: bool = True, **kwargs) -> Model:
    """Load a ``.keras`` file written by ``save``/``save_model`` (on all ranks).

    ``parallel_strategy=PIPELINING|ALL, num_pipeline_stages=q`` loads it into q stages
    (any q, whatever the file was saved with; see tnt.pipelining.load_model);
    ``parallel_strategy=TENSOR, tensor_parallel_size=q`` splits it over q ranks (any q,
    whatever t it was saved at; see tnt.tensor_parallel.load_model); ``ALL`` with
    ``tensor_parallel_size=q`` over data replicas of q-rank tensor groups.
    """
    strategy = ParallelStrategy(kwargs.get("parallel_strategy", ParallelStrategy.DATA))
    if strategy is ParallelStrategy.TENSOR or (
            strategy is ParallelStrategy.ALL and kwargs.get("tensor_parallel_size", 1) != 1):
        from .tensor_parallel import load_model as load_tensor_parallel

        kwargs["parallel_strategy"] = strategy.value
        return load_tensor_parallel(filepath, custom_objects=custom_objects, compile=compile, **kwargs)
    if ParallelStrategy(kwargs.get("parallel_strategy", ParallelStrategy.DATA)) is not ParallelStrategy.DATA:
        from .pipelining import load_model as load_pipelined

        return load_pipelined(filepath, custom_objects=custom_objects, compile=compile, **kwargs)
    kwargs.pop("parallel_strategy", None)
    with _io.master_file(filepath) as local:
        inner = keras.models.load_model(local, custom_objects=custom_objects, compile=compile, **kwargs)
    return Model(inner)


def save_model(model, filepath, overwrite: bool = True, **kwargs) -> None:
    """Save ``model`` from the master rank, atomically."""
    if isinstance(model, Model):
        model.save(filepath, overwrite=overwrite, **kwargs)
        return
    _io.save_on_master(filepath, lambda tmp: model.save(tmp, overwrite=True, **kwargs))


def model_from_config(config: dict[str, Any], custom_objects=None) -> Model:
    """Rebuild a (fresh, untrained) model from ``get_config()`` output."""
    if "class_name" in config:
        inner = keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)
    elif "layers" in config and "input_layers" not in config:
        inner = keras.Sequential.from_config(config, custom_objects=custom_objects)
    else:
        inner = keras.Model.from_config(config, custom_objects=custom_objects)
    return Model(inner)


def model_from_json(json_string: str, custom_objects=None) -> Model:
    """Rebuild a model from ``to_json()`` output."""
    json.loads(json_string)  # a clear JSONDecodeError before Keras' own message
    return Model(keras.models.model_from_json(json_string, custom_objects=custom_objects))


def clone_model(model, **kwargs) -> Model:
    """A new model with the same architecture and freshly initialised weights."""
    return Model(keras.models.clone_model(_inner(model), **kwargs))
