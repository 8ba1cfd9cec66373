"""Serial-shaped files, shared by every layout: whatever the layout, a file is the one a
serial Keras model writes, and every layout reads its own part of such a file.

Optimizer variables are matched by the model variable they belong to, named
``"<layer>/<index of the weight in the layer>"`` plus the slot's name (Keras names slots
after the variable's path, which differs between a stage or shard model and the serial
model); a name an optimizer lists twice (a wrapper's and its inner optimizer's
``iteration``) is numbered from its second use on. Files are opened where every rank sees
them, or shipped from the master.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import zipfile

import keras
import numpy as np

import tnt_comm

from . import files as _io
from . import internals as _internals
from . import runtime as _runtime
from .deferred import deferred_variables, is_deferred


def clone_optimizer(optimizer) -> keras.optimizers.Optimizer:
    """A fresh optimizer with ``optimizer``'s configuration (strings accepted)."""
    optimizer = keras.optimizers.get(optimizer)
    return optimizer.__class__.from_config(optimizer.get_config())


def variable_keys(model: keras.Model) -> dict[int, str]:
    """id(variable) -> ``"<layer>/<index>"``, named after the outermost layer holding it
    that is no model: a nested model's layers name their own variables, so a pipeline
    stage (nested models flattened) and the serial model agree."""
    keys = {}
    for layer in _internals.all_sublayers(model):  # parents first
        if isinstance(layer, keras.Model):
            continue
        for j, var in enumerate(layer.weights):
            keys.setdefault(id(var), f"{layer.name}/{j}")
    return keys


def numbered_keys(keys: list[str]) -> list[str]:
    """``keys`` with a repeated one numbered from its second use on (``"iteration#1"``): a
    wrapping optimizer (LossScaleOptimizer) lists its own step counter and its inner
    optimizer's, both named ``iteration``, which must not take each other's value."""
    seen: dict[str, int] = {}
    out = []
    for key in keys:
        n = seen.get(key, 0)
        seen[key] = n + 1
        out.append(key if n == 0 else f"{key}#{n}")
    return out


def optimizer_keys(optimizer, model: keras.Model) -> list[str]:
    """The model-independent key (see module docstring) of each of ``optimizer.variables``."""
    keys = variable_keys(model)
    prefixes = sorted(((v.path.replace("/", "_"), keys[id(v)]) for v in model.trainable_variables
                       if id(v) in keys), key=lambda p: -len(p[0]))
    out = []
    for var in optimizer.variables:
        name = var.name
        key = name
        for prefix, vkey in prefixes:
            if name.startswith(prefix + "_"):
                key = f"{vkey}|{name[len(prefix) + 1:]}"
                break
        out.append(key)
    return numbered_keys(out)


def serial_optimizer_keys(optimizer, model: keras.Model) -> list[str]:
    """The keys of the variables ``optimizer`` has once built on ``model``, in their order
    (the order of a saved file's ``optimizer/vars``), without building it on the model.

    A clone is built on one tiny stand-in per trainable variable (same rank and dtype,
    named by its position), and its slot names are mapped back to the model's variables.
    """
    names = variable_keys(model)
    trainable = model.trainable_variables
    stand_ins = [keras.Variable(initializer="zeros", shape=(1,) * len(v.shape), dtype=v.dtype,
                                name=f"tnt_proxy_{j}", trainable=True) for j, v in enumerate(trainable)]
    clone = clone_optimizer(optimizer)
    clone.build(stand_ins)
    keys = []
    for var in clone.variables:
        found = re.match(r"tnt_proxy_(\d+)_(.+)", var.name)
        keys.append(f"{names[id(trainable[int(found[1])])]}|{found[2]}" if found else var.name)
    return numbered_keys(keys)


def optimizer_state(optimizer, model: keras.Model) -> dict[str, np.ndarray]:
    """The optimizer's variables by model-independent key; deferred ones are left out."""
    if optimizer is None or not optimizer.built:
        return {}
    return {key: np.asarray(var.numpy()) for key, var in zip(optimizer_keys(optimizer, model), optimizer.variables)
            if not is_deferred(var)}


def assign_optimizer_state(optimizer, model: keras.Model, state: dict[str, np.ndarray]) -> int:
    """Assign ``state`` to the (built) optimizer's matching variables; returns how many."""
    if not state:
        return 0
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    by_key = dict(zip(optimizer_keys(optimizer, model), optimizer.variables))
    done = 0
    for key, var in by_key.items():
        if key in state:
            var.assign(state[key])
            done += 1
    return done


@contextlib.contextmanager
def open_model_file(filepath):
    """(local path, open .keras archive or None): every rank reads only what it needs.

    When every rank sees ``filepath`` it is opened in place; otherwise the master's copy is
    shipped to every rank first (``_io.master_file``: the whole file crosses the network).
    """
    path = os.fspath(filepath)
    seen = tnt_comm.allgather_object(os.path.exists(path)) if _runtime.get_size() > 1 else [True]
    with contextlib.ExitStack() as stack:
        local = path if all(seen) else stack.enter_context(_io.master_file(path))
        if zipfile.is_zipfile(local):
            archive = stack.enter_context(zipfile.ZipFile(local, "r"))
            yield "model.weights.h5", archive
        else:
            yield local, None


def deferred_from_file(archive, custom_objects, compile: bool, safe_mode: bool) -> keras.Model:
    """The model of a .keras file, compiled as Keras compiles it, with deferred variables.

    Keras' own loading compiles inside the deserialisation and builds the optimizer's slots
    (as large as the model) right away; here the optimizer is compiled but never built.
    """
    config = json.loads(archive.read("config.json").decode())
    compile_config = config.pop("compile_config", None) if compile else None
    with deferred_variables():
        full = _internals.model_from_saved_config(json.dumps(config), custom_objects, False, safe_mode)
    if compile_config:  # the optimizer stays unbuilt: serial_optimizer_keys knows its layout
        with keras.saving.custom_object_scope(custom_objects or {}):
            args = keras.saving.deserialize_keras_object(compile_config)
        full.compile(**args)
    return full
