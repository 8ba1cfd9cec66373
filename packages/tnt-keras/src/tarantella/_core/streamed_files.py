"""Serial files written array by array: no rank ever holds the whole model to save it.

The master builds the serial model from its configuration with deferred variables (shapes,
no memory: ``deferred``), records what Keras' own save walk would hand its weights store
(``_internals.recorded_save_walk``: groups with their metadata, then each variable) and
replays that walk into a real HDF5 file, asking ``fetch`` for each array just before it is
written (from this rank's own part, or in a message from the rank holding it) and
dropping it right after. A ``.keras`` file is Keras' zip of ``metadata.json``,
``config.json`` and ``model.weights.h5``: the weights file is written next to the target
first, then copied into the zip in chunks. The result is the file Keras' own ``save`` /
``save_weights`` writes of the serial model holding the same state.

The optimizer's part is Keras' walk of a fresh optimizer of the same configuration built
on one tiny stand-in per trainable variable (``serial_files``): its layout (groups, order,
inner optimizers) is the serial model's, its variables are named by the model-independent
keys, and the values come from the ranks holding them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

import keras
import numpy as np

import tnt_comm

from . import internals as _internals
from . import runtime as _runtime
from .deferred import current_or_initial
from .serial_files import clone_optimizer, numbered_keys, variable_keys


class StreamedWrite(Protocol):
    """One streamed save: ``serve`` off the master (answers the master's requests until it
    is done), ``write(path)`` on the master (writes the file at ``path``)."""

    def serve(self) -> None: ...

    def write(self, path: str) -> None: ...


class Weight(NamedTuple):
    """Weight ``index`` of layer ``layer`` of the serial model (a request to its holder)."""

    layer: str
    index: int


class OptimizerValue(NamedTuple):
    """An optimizer variable by model-independent key (``"<layer>/<j>|<slot>"``, or its own
    name for the step counter and the like); ``layer`` holds the weight of a slot."""

    key: str
    layer: str | None


#: What the master asks for: a weight or an optimizer variable; the answer is an array or
#: None (the holder has none: the serial model's initial value is written).
Request = Weight | OptimizerValue


class _Planned(NamedTuple):
    request: Request
    fallback: Callable[[], np.ndarray]


def variable_view(variable) -> np.ndarray:
    """``variable``'s value as an array viewing its memory where the backend allows it:
    a TensorFlow variable's read is its buffer (``np.asarray(variable)`` would copy it),
    kept alive by the array. Nobody changes a variable while a save streams it."""
    value = getattr(variable, "value", variable)
    read = getattr(value, "read_value", None)
    return np.asarray(read() if read is not None else value)


def _initial(variable) -> np.ndarray:
    """The serial model's own value of ``variable`` (its initializer's, when deferred)."""
    return np.asarray(current_or_initial(variable))


def _weight_events(model: keras.Model, skip: tuple) -> list[tuple] | None:
    """Keras' save walk of ``model`` with each variable replaced by its request; None when
    a layer stores something else than one of its variables (a merged LoRA kernel, ...)."""
    keys = variable_keys(model)
    by_id = {id(v): v for v in model.weights}
    out = []
    for event in _internals.recorded_save_walk(model, "", skip):
        if event[0] == "set":
            value = event[2]
            if id(value) not in keys or id(value) not in by_id:
                return None
            layer, index = keys[id(value)].rsplit("/", 1)
            event = ("set", event[1], _Planned(Weight(layer, int(index)),
                                              functools.partial(_initial, value)))
        out.append(event)
    return out


def _broadcast_value(variable, shape: tuple[int, ...] | None) -> np.ndarray:
    """A stand-in optimizer variable's value, broadcast to the model variable's shape."""
    value = np.asarray(variable.numpy())
    return value if shape is None else np.array(np.broadcast_to(value, shape))


def _optimizer_events(optimizer, model: keras.Model, built: bool) -> list[tuple]:
    """Keras' save walk of ``optimizer`` (at ``optimizer``) as built on ``model`` (unbuilt if
    not ``built``), each variable replaced by its request.

    A clone is built on one stand-in per trainable variable (same rank and dtype, named by
    its position): its slots' names give the keys, its values the fallbacks (a fresh
    optimizer's), broadcast to the model variable's shape.
    """
    names = variable_keys(model)
    trainable = model.trainable_variables
    clone = clone_optimizer(optimizer)
    if built:
        clone.build([keras.Variable(initializer="zeros", shape=(1,) * len(v.shape), dtype=v.dtype,
                                    name=f"tnt_proxy_{j}", trainable=True) for j, v in enumerate(trainable)])
    # The keys of the clone's variables in its own order (serial_files numbers a name
    # listed twice, as a wrapper's and its inner optimizer's step counters).
    numbered = dict(zip((id(v) for v in clone.variables), numbered_keys([v.name for v in clone.variables])))
    out = []
    owner = clone
    for event in _internals.recorded_save_walk(clone, "optimizer"):
        if event[0] == "make":
            owner = clone
            for part in event[1].split("/")[1:]:  # an inner optimizer's group
                owner = getattr(owner, part)
            out.append(event)
            continue
        var = owner.variables[int(event[1])]
        found = re.match(r"tnt_proxy_(\d+)_(.+)", var.name)
        if found:
            model_var = trainable[int(found[1])]
            key = f"{names[id(model_var)]}|{found[2]}"
            layer = names[id(model_var)].rsplit("/", 1)[0]
            shape = tuple(int(d) for d in model_var.shape)
            fallback = functools.partial(_broadcast_value, var, shape)
        else:
            key, layer = numbered.get(id(var), var.name), None
            fallback = functools.partial(_broadcast_value, var, None)
        out.append(("set", event[1], _Planned(OptimizerValue(key, layer), fallback)))
    return out


def save_events(model: keras.Model, optimizer=None, optimizer_built: bool = False) -> list[tuple] | None:
    """What a streamed save of ``model`` (deferred: shapes only) writes, in Keras' order,
    with ``optimizer``'s state when given (``model`` compiled with it, unbuilt); None when
    the model cannot be streamed (a layer saving assets or computed values): gather it."""
    if _internals.has_assets(model):
        return None
    skip = (model.optimizer,) if getattr(model, "optimizer", None) is not None else ()
    events = _weight_events(model, skip)
    if events is None:
        return None
    if optimizer is not None:
        events += _optimizer_events(optimizer, model, optimizer_built)
    return events


def events_on_every_rank(events: list[tuple] | None) -> bool:
    """Whether the master made the save walk (``events`` there; every rank calls it): a
    stream exists only if it did, so every rank must take the same branch (a collective)."""
    if _runtime.get_size() == 1:
        return events is not None
    return bool(tnt_comm.broadcast_object(events is not None if _runtime.is_master_rank() else None, 0))


def _replay(store, events: list[tuple], fetch: Callable[[Request], np.ndarray | None]) -> None:
    for event in events:
        if event[0] == "make":
            store.make(event[1], metadata=event[2])
            continue
        planned = event[2]
        value = fetch(planned.request)
        store[event[1]] = planned.fallback() if value is None else value
        del value  # one array at a time


def write(kind: str, path: str, model: keras.Model, events: list[tuple],
          fetch: Callable[[Request], np.ndarray | None]) -> None:
    """``kind`` "model": the ``.keras`` file of ``model``; else its ``.weights.h5``."""
    if kind == "model":
        write_model(path, model, events, fetch)
    else:
        write_weights(path, events, fetch)


def write_weights(path: str, events: list[tuple], fetch: Callable[[Request], np.ndarray | None]) -> None:
    """The serial model's ``.weights.h5`` at ``path``, array by array."""
    store = _internals.h5_writer(path)
    try:
        _replay(store, events, fetch)
    finally:
        store.close()


def write_model(path: str, model: keras.Model, events: list[tuple],
                fetch: Callable[[Request], np.ndarray | None]) -> None:
    """The serial model's ``.keras`` file at ``path``: Keras' zip of its metadata, its
    configuration (``model``: deferred, compiled as the file says) and the weights file,
    written next to ``path`` first and copied into the zip in chunks."""
    config_json, metadata_json = _internals.model_file_json(model)
    target = Path(path)
    fd, weights = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".weights.h5", dir=target.parent)
    os.close(fd)
    try:
        write_weights(weights, events, fetch)
        with zipfile.ZipFile(target, "w") as zf:  # Keras' layout and (stored) compression
            with zf.open("metadata.json", "w") as f:
                f.write(metadata_json.encode())
            with zf.open("config.json", "w") as f:
                f.write(config_json.encode())
            zf.write(weights, "model.weights.h5")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(weights)


__all__ = ["OptimizerValue", "Request", "StreamedWrite", "Weight", "save_events", "variable_view", "write_model",
           "write_weights"]
