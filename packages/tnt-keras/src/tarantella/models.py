"""``tnt.models``: Keras' model functions, returning ``tnt.Model``s.

Files are plain Keras 3 files (``.keras`` for whole models); the master rank reads them
and shares the bytes, so every rank loads the same model even without a shared disk.
"""

from __future__ import annotations

import json
from typing import Any

import keras

from ._core import files as _io
from ._core.distributed import DistributedModel
from ._core.strategy import ParallelStrategy, split_options
from .data_parallel import Model

__all__ = ["clone_model", "load_model", "model_from_config", "model_from_json", "save_model"]


def _inner(model) -> keras.Model:
    return model.model if isinstance(model, Model) else model


def load_model(filepath, custom_objects=None, compile: bool = True, **kwargs) -> keras.Model:
    """Load a ``.keras`` file written by ``save``/``save_model`` (on all ranks).

    The file is a serial Keras file whatever layout wrote it, and loads into any layout:
    ``parallel_strategy=PIPELINING|ALL, num_pipeline_stages=q`` into q stages (any q,
    see tnt.pipelining.load_model); ``parallel_strategy=TENSOR, tensor_parallel_size=q``
    split over q ranks (any q, see tnt.tensor_parallel.load_model); ``ALL`` with
    ``tensor_parallel_size=q`` over data replicas of q-rank tensor groups. With nothing to
    split (one rank, one stage, q = 1) it loads as data-parallel replicas.
    """
    parallel_strategy = kwargs.pop("parallel_strategy", ParallelStrategy.DATA)
    member, strategy, options, rest = split_options(parallel_strategy, kwargs, where="tnt.models.load_model")
    loaded = strategy.load(filepath, member, options, custom_objects=custom_objects, compile=compile, **rest)
    if loaded is not None:
        return loaded
    with _io.master_file(filepath) as local:
        inner = keras.models.load_model(local, custom_objects=custom_objects, compile=compile, **rest)
    # Nothing to split: data-parallel replicas, with DATA's own options (``sharding=``) only;
    # another strategy's (``tensor_parallel_size=1``) were about what is not split.
    # ALL's replica axis takes DATA's sharding= too.
    kept = options if member is ParallelStrategy.DATA else {k: v for k, v in options.items() if k == "sharding"}
    return Model(inner, **kept)


def save_model(model, filepath, overwrite: bool = True, **kwargs) -> None:
    """Save ``model`` (any layout: every rank calls it) as one serial Keras file, written
    by the master atomically; a plain Keras model is written by the master as it is."""
    if isinstance(model, DistributedModel):
        model.save(filepath, overwrite=overwrite, **kwargs)
        return
    if _io.may_write(filepath, overwrite):
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
