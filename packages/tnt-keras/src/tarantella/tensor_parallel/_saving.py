"""Save a tensor-parallel model as one ordinary Keras file; load a file into any t.

Saving: every rank of the tensor group takes part in joining the split variables (each
shard of a weight, and of its optimizer slots, allgathered along its split axis); the
master then builds the serial model from its config, fills it, compiles it with a fresh
optimizer holding the joined state and writes it with Keras' own ``save`` / ``save_weights``
(once, atomically: ``_io.save_on_master``). The file is a plain serial Keras file.

Loading: every rank builds the file's model with deferred variables (shapes, no memory:
``_core.deferred``), builds its shards, gives values to the replicated layers only,
and reads from the file's ``model.weights.h5`` the replicated layers whole and, of every
split variable and its optimizer slots, only its own slice (an h5py hyperslab: the rest of
the dataset is never read). The file may have been saved serially or at any t; it loads
at any q. Split variables are found in the file by asking Keras where it writes them
(``_internals.saved_variable_locations``), optimizer slots by the model-independent keys
of pipelining's saving (``"<layer>/<weight index>|<slot>"``).
"""

from __future__ import annotations

import copy

import keras
import numpy as np

import tnt_comm

from .._core import internals as _internals
from .._core import runtime as _runtime
from .._core.deferred import is_deferred
from .._core.errors import TensorParallelError
from .._core.serial_files import (
    assign_optimizer_state,
    open_model_file,
    optimizer_keys,
    serial_optimizer_keys,
    variable_keys,
)


def _split_keys(tpm) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{"<layer>/<weight index>": (split axis, local shape)} of the split variables.

    The key is the serial model's; the shard layer must hold the same weight at the same
    index (it does: shards build their weights in the serial layer's order).
    """
    serial_keys, local_keys = variable_keys(tpm._serial), variable_keys(tpm.local_model)
    out = {}
    for serial, local, axis in tpm._split_variables():
        key = serial_keys[id(serial)]
        if local_keys.get(id(local)) != key:  # pragma: no cover - a shard layer's bug
            raise TensorParallelError(f"shard variable {local.path} is not at the place of {serial.path} "
                                      f"({local_keys.get(id(local))} vs {key}).")
        if axis is not None:
            out[key] = (axis, tuple(int(d) for d in local.shape))
    return out


def _slot_axis(key: str, var, split: dict) -> int | None:
    """The split axis of optimizer variable ``var`` (key ``"<layer>/<j>|<slot>"``), if any."""
    found = split.get(key.split("|", 1)[0]) if "|" in key else None
    if found is None:
        return None
    axis, shape = found
    if tuple(int(d) for d in var.shape) != shape:
        raise TensorParallelError(
            f"optimizer variable {var.path} has shape {tuple(var.shape)}, not the shape {shape} of the "
            "shard it belongs to: this optimizer keeps slots that are not shaped like the variables "
            "(e.g. factored ones), which cannot be split with the layer. Use an element-wise optimizer "
            "(SGD, Adam, RMSprop, ...).")
    return axis


# -- saving ---------------------------------------------------------------------------------------
def _joined_optimizer_state(tpm) -> dict[str, np.ndarray]:
    """The optimizer's variables by key, split slots joined (collective on the group)."""
    optimizer = tpm.optimizer
    if optimizer is None or not optimizer.built:
        return {}
    split = _split_keys(tpm)
    return {key: tpm._gather(var, _slot_axis(key, var, split))
            for key, var in zip(optimizer_keys(optimizer, tpm.local_model), optimizer.variables)}


def gather_serial_model(tpm, with_optimizer: bool = True) -> keras.Model | None:
    """The whole serial model (with optimizer state) on the master; None elsewhere.

    Every rank of the tensor group must call it (the shards are allgathered).
    """
    weights = tpm.get_weights()
    state = _joined_optimizer_state(tpm) if with_optimizer else {}
    if not _runtime.is_master_rank():
        return None
    with tnt_comm.long_local_work():  # the others wait in save_on_master's barrier meanwhile
        serial = tpm._serial
        full = type(serial).from_config(copy.deepcopy(serial.get_config()))  # from_config consumes it
        full.set_weights(weights)
        if with_optimizer and tpm.compiled and tpm.optimizer is not None:
            args = keras.saving.deserialize_keras_object(tpm.get_compile_config())
            args.pop("jit_compile", None)  # the wrapper's False is not the user's choice
            full.compile(**args)
            assign_optimizer_state(full.optimizer, full, state)
    return full


# -- loading --------------------------------------------------------------------------------------
def _read_slice(dataset, shape: tuple[int, ...], axis: int | None, rank: int, t: int, what: str) -> np.ndarray:
    """Of a saved variable, the part a variable of ``shape`` holds: all of it, or slice
    ``rank`` of ``t`` along ``axis`` (only that part is read from the file)."""
    saved = tuple(int(d) for d in dataset.shape)
    if saved == shape:
        return np.asarray(dataset[()])
    if axis is None or saved != tuple(d * t if i == axis else d for i, d in enumerate(shape)):
        raise TensorParallelError(
            f"{what}: the file holds shape {saved}, but this model needs {shape}"
            f"{f' (a 1/{t} slice along axis {axis})' if axis is not None else ''}. The file is not of "
            "this model: load it with the model it was saved from.")
    index = [slice(None)] * len(shape)
    index[axis] = slice(rank * shape[axis], (rank + 1) * shape[axis])
    return np.asarray(dataset[tuple(index)])


def _read_split_layers(tpm, store, paths: dict[str, str]) -> None:
    """Each split layer's shard variables (a slice of each), and its other variables whole."""
    r, t = tpm.group.rank, tpm.group.size
    by_serial = {id(s): (local, axis) for s, local, axis in tpm._split_variables()}
    for name in tpm._tnt_shards:
        serial = next(layer for layer in tpm._serial.layers if layer.name == name)
        where = _internals.saved_variable_locations(serial, paths[name])
        for var in serial.variables:
            if id(var) not in where:
                continue  # not in the file (Keras does not save it): keeps its initial value
            dataset = _internals.h5_dataset(store, *where[id(var)])
            if dataset is None:
                raise TensorParallelError(f"the file has no value for {var.path} (layer {name!r}); it is not "
                                          "a file of this model.")
            if id(var) in by_serial:
                local, axis = by_serial[id(var)]
                local.assign(_read_slice(dataset, tuple(int(d) for d in local.shape), axis, r, t, var.path))
            elif not is_deferred(var):  # e.g. the attention dropout's seed
                var.assign(_read_slice(dataset, tuple(int(d) for d in var.shape), None, r, t, var.path))
        missing = [v.path for v in serial.weights if id(v) in by_serial and id(v) not in where]
        if missing:  # pragma: no cover - Keras wrote a copy, not the variable
            raise TensorParallelError(f"cannot find {missing} in the file's layout.")


def _read_optimizer(tpm, full: keras.Model, full_optimizer, store) -> None:
    optimizer = tpm.optimizer
    if full_optimizer is None or optimizer is None:
        return
    if not len(store.get("optimizer")):
        return  # saved without optimizer state
    if not optimizer.built:
        optimizer.build(tpm.trainable_variables)
    split = _split_keys(tpm)
    r, t = tpm.group.rank, tpm.group.size
    mine = dict(zip(optimizer_keys(optimizer, tpm.local_model), optimizer.variables))
    for k, key in enumerate(serial_optimizer_keys(full_optimizer, full)):
        var = mine.get(key)
        if var is not None:
            dataset = _internals.h5_dataset(store, "optimizer", str(k))
            var.assign(_read_slice(dataset, tuple(int(d) for d in var.shape), _slot_axis(key, var, split),
                                   r, t, var.path))


def read_tensor_state(tpm, full: keras.Model, full_optimizer, store) -> None:
    """Fill this rank's variables (and optimizer) from ``store``, a file of the serial model.

    ``full`` is the serial model (``tpm``'s own, possibly deferred: only its layout is
    used for split layers), ``full_optimizer`` its optimizer (only its configuration is used).
    """
    nested = sorted(set(tpm._tnt_shards) - {layer.name for layer in full.layers})
    if nested:  # the same on every rank: the plan is
        raise TensorParallelError(
            f"reading a file into split layers inside a nested model ({', '.join(nested[:3])}) is not supported "
            "yet. Load it into the Keras model (keras.saving.load_model or its load_weights) and wrap that with "
            "tnt.Model.")
    paths = _internals.saved_layer_paths(full)
    for layer in full.layers:
        if layer.weights and layer.name not in tpm._tnt_shards:
            _internals.load_layer_state(layer, store, paths[layer.name])
    _read_split_layers(tpm, store, paths)
    _read_optimizer(tpm, full, full_optimizer, store)


def load_weights(tpm, filepath) -> None:
    """``model.load_weights``: a serial weights (or .keras) file saved at any t; this rank
    reads its slices and the replicated layers."""
    with open_model_file(filepath) as (local, archive):
        read_tensor_state(tpm, tpm._serial, tpm.optimizer, _internals.weights_store(local, archive))


__all__ = ["gather_serial_model", "load_weights", "read_tensor_state"]
