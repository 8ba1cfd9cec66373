"""Save a tensor-parallel model as one ordinary Keras file; load a file into any t.

Saving (``streamed_save``): the master (rank 0 of the first tensor group) writes the file
array by array (``_core.streamed_files``): it builds the serial model from its config with
deferred variables (shapes, no memory), replays Keras' save walk of it and, for each
variable, writes its own copy (a replicated variable) or joins a split one just before
writing it: its own slice and, asked one rank at a time (``_core.array_requests``), every
other rank's slice of the group, each copied into place and freed. No rank holds more
than its own shards plus one serial variable (and one slice); with sharded data replicas,
replica 0 of each shard first holds its shard's whole optimizer state, as for a gather.
The file is the one Keras' own ``save`` / ``save_weights`` writes of the serial model
(once, atomically: ``_io.save_on_master``). ``gather_serial_model`` (every split variable
allgathered, the whole serial model filled on the master) remains for ``export`` and what
a stream does not cover (extra ``save`` arguments, a layer saving assets or computed values).

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
import functools

import keras
import numpy as np

import tnt_comm

from .._core import array_requests as _requests
from .._core import internals as _internals
from .._core import runtime as _runtime
from .._core import streamed_files as _streamed
from .._core.deferred import deferred_variables, is_deferred
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


def _compile_arguments(tpm) -> dict:
    """The user's compile arguments, as the serial model in the file is compiled."""
    args = keras.saving.deserialize_keras_object(tpm.get_compile_config())
    args.pop("jit_compile", None)  # the wrapper's False is not the user's choice
    return args


def _serial_from_config(tpm, deferred: bool) -> keras.Model:
    """A new serial model from ``tpm``'s config (from_config consumes it: a copy);
    ``deferred``: shapes only, no memory."""
    serial = tpm._serial
    config = copy.deepcopy(serial.get_config())
    if deferred:
        with deferred_variables():
            return type(serial).from_config(config)
    return type(serial).from_config(config)


def gather_serial_model(tpm, with_optimizer: bool = True) -> keras.Model | None:
    """The whole serial model (with optimizer state) on the master; None elsewhere.

    Every rank of the tensor group must call it (the shards are allgathered).
    """
    weights = tpm.get_weights()
    state = _joined_optimizer_state(tpm) if with_optimizer else {}
    if not _runtime.is_master_rank():
        return None
    with tnt_comm.long_local_work():  # the others wait in save_on_master's barrier meanwhile
        full = _serial_from_config(tpm, deferred=False)
        full.set_weights(weights)
        if with_optimizer and tpm.compiled and tpm.optimizer is not None:
            full.compile(**_compile_arguments(tpm))
            assign_optimizer_state(full.optimizer, full, state)
    return full


# -- streamed save ----------------------------------------------------------------------------
class _ShardHoldings:
    """What this rank holds of the serial file, by the file's keys: each variable of the
    local model (a slice of a split one) and of its optimizer, with its split axis (None:
    the whole variable, the same on every rank of the group). Nothing is copied."""

    def __init__(self, tpm, with_optimizer: bool) -> None:
        split = _split_keys(tpm)
        keys = variable_keys(tpm.local_model)
        self.weights = {}
        for var in tpm.local_model.weights:
            key = keys.get(id(var))
            if key is not None:
                self.weights[key] = (var, split[key][0] if key in split else None)
        optimizer = tpm.optimizer if with_optimizer else None
        self.optimizer_built = optimizer is not None and optimizer.built
        self.optimizer = {}
        if self.optimizer_built:
            self.optimizer = {key: (var, _slot_axis(key, var, split))
                              for key, var in zip(optimizer_keys(optimizer, tpm.local_model), optimizer.variables)
                              if not is_deferred(var)}

    def find(self, request: _streamed.Request) -> tuple[object | None, int | None]:
        """(variable, split axis) that ``request`` names; (None, None): not held."""
        if isinstance(request, _streamed.Weight):
            return self.weights.get(f"{request.layer}/{request.index}", (None, None))
        return self.optimizer.get(request.key, (None, None))

    def get(self, request: _streamed.Request) -> np.ndarray | None:
        """This rank's value of ``request`` (its slice of a split variable), viewing the
        variable's memory where it can; None: not held."""
        var, _ = self.find(request)
        return None if var is None else _streamed.variable_view(var)


class StreamedShards:
    """A streamed save of a tensor-parallel model (see ``_core.streamed_files``): the
    master writes, joining each split variable from the slices the other ranks of its
    tensor group send it one at a time; other replicas' groups take no part."""

    def __init__(self, tpm, kind: str, holdings: _ShardHoldings | None, full: keras.Model | None,
                 events: list[tuple] | None) -> None:
        self.size = tpm.group.size
        self.peers = _requests.CommPeers(tpm.group.comm) if tpm.group.comm is not None else None
        self.serving = tpm.replica == 0 and tpm.group.rank != 0
        if _runtime.is_master_rank() and tpm.group.rank != 0:  # pragma: no cover - the mesh's order
            raise TensorParallelError(f"the master is rank {tpm.group.rank} of its tensor group, not 0.")
        self.kind = kind
        self.holdings = holdings
        self.full = full
        self.events = events

    def serve(self) -> None:
        """Off the master, on the master's tensor group: answer its requests with this
        rank's slices until it is done (nothing elsewhere)."""
        if self.serving:
            _requests.serve(self.peers, 0, self.holdings.get)  # each slice is freed before the next

    def write(self, path: str) -> None:
        """On the master: write the file at ``path``; the group is told to stop whatever
        happens here."""
        asker = _requests.Asker(self.peers, range(1, self.size))
        try:
            fetch = functools.partial(self._fetch, asker=asker)
            _streamed.write(self.kind, path, self.full, self.events, fetch)
        finally:
            asker.stop()

    def _fetch(self, request: _streamed.Request, asker: _requests.Asker) -> np.ndarray | None:
        """The serial value of ``request``: the master's own (replicated), or the group's
        slices joined along the split axis in rank order, each slice freed once copied."""
        var, axis = self.holdings.find(request)
        if var is None:
            return None
        mine = _streamed.variable_view(var)
        if axis is None or self.size == 1:
            return mine
        width = mine.shape[axis]
        whole = np.empty(tuple(d * self.size if i == axis else d for i, d in enumerate(mine.shape)), mine.dtype)
        index = [slice(None)] * mine.ndim
        for r in range(self.size):
            part = mine if r == 0 else asker.ask(r, request)
            if part is None or part.shape != mine.shape or part.dtype != mine.dtype:  # pragma: no cover
                raise TensorParallelError(f"rank {r} of the tensor group holds {request} as "
                                          f"{None if part is None else (part.dtype, part.shape)}, "
                                          f"not a slice like rank 0's {(mine.dtype, mine.shape)}.")
            index[axis] = slice(r * width, (r + 1) * width)
            whole[tuple(index)] = part
            del part
        return whole


def streamed_save(tpm, kind: str, with_optimizer: bool) -> StreamedShards | None:
    """A streamed save (``kind``: "model" for .keras, "weights" for .weights.h5) of
    ``tpm``, or None when its serial model cannot be streamed (then gather it). Every rank
    calls it (the decision is the master's); sharded replicas call it with their shard's
    whole optimizer state in place (``_model``)."""
    with_optimizer = with_optimizer and tpm.compiled and tpm.optimizer is not None
    holdings = _ShardHoldings(tpm, with_optimizer) if tpm.replica == 0 else None
    full = events = None
    if _runtime.is_master_rank():
        full = _serial_from_config(tpm, deferred=True)
        optimizer = None
        if with_optimizer:
            full.compile(**_compile_arguments(tpm))
            optimizer = full.optimizer
        events = _streamed.save_events(full, optimizer, holdings.optimizer_built)
    if not _streamed.events_on_every_rank(events):
        return None
    return StreamedShards(tpm, kind, holdings, full, events)


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


__all__ = ["StreamedShards", "gather_serial_model", "load_weights", "read_tensor_state", "streamed_save"]
