"""Save a pipelined model as one ordinary Keras file; load a file into any number of stages.

Saving: the stages of replica 0 send their layers' weights and optimizer state to the
master (stage 0 of replica 0) over point-to-point messages; the master rebuilds the serial
model from its config, fills it, compiles it with a fresh optimizer holding the gathered
state and writes it with Keras' own ``save`` (atomically, ``_io.save_on_master``). Only
the master holds the whole model, and only while writing.

Loading: every rank builds the model from the file's config with deferred variables
(shapes, no memory: ``_deferred``), plans the stages, builds its stage, and reads only
its stage's layer groups and optimizer variables from the file's ``model.weights.h5``
(h5py reads datasets one by one, through the zip). No rank materialises the whole
model. The stage count is free: q stages from a file saved with p, or saved serially.

Optimizer variables are matched by the model variable they belong to, named
``"<layer>/<index of the weight in the layer>"`` plus the slot's name (Keras names slots
after the variable's path, which differs between a stage model and the serial model).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import re
import zipfile

import keras
import numpy as np

import tnt_comm

from .. import _internals, _io, _runtime
from ..keras._split_layer import SplitLayer
from ._deferred import deferred_variables, is_deferred
from ._graph import model_graph
from ._plan import plan as make_plan
from ._plan import stages_from_markers
from ._stage_runtime import clone_optimizer

#: Header "step" of save messages (never a training step number).
_SAVE_STEP = 2**30


def _variable_keys(model: keras.Model) -> dict[int, str]:
    keys = {}
    for layer in model.layers:
        for j, var in enumerate(layer.weights):
            keys.setdefault(id(var), f"{layer.name}/{j}")
    return keys


def optimizer_keys(optimizer, model: keras.Model) -> list[str]:
    """The model-independent key (see module docstring) of each of ``optimizer.variables``."""
    keys = _variable_keys(model)
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
    return out


def serial_optimizer_keys(optimizer, model: keras.Model) -> list[str]:
    """The keys of the variables ``optimizer`` has once built on ``model``, in their order
    (the order of a saved file's ``optimizer/vars``), without building it on the model.

    A clone is built on one tiny stand-in per trainable variable (same rank and dtype,
    named by its position), and its slot names are mapped back to the model's variables.
    """
    names = _variable_keys(model)
    trainable = model.trainable_variables
    stand_ins = [keras.Variable(initializer="zeros", shape=(1,) * len(v.shape), dtype=v.dtype,
                                name=f"tnt_proxy_{j}", trainable=True) for j, v in enumerate(trainable)]
    clone = clone_optimizer(optimizer)
    clone.build(stand_ins)
    keys = []
    for var in clone.variables:
        found = re.match(r"tnt_proxy_(\d+)_(.+)", var.name)
        keys.append(f"{names[id(trainable[int(found[1])])]}|{found[2]}" if found else var.name)
    return keys


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


def _send_object(transport, obj, stage: int, tag: int) -> list:
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    length = np.array([data.size], dtype=np.int64)
    return [transport.isend(length, stage, (_SAVE_STEP, 0, tag)),
            transport.isend(data, stage, (_SAVE_STEP, 1, tag))]


def _recv_object(transport, stage: int, tag: int):
    length = int(transport.recv(stage, (_SAVE_STEP, 0, tag), np.int64, (1,))[0])
    data = transport.recv(stage, (_SAVE_STEP, 1, tag), np.uint8, (length,))
    return pickle.loads(data.tobytes())


def _stage_payload(pm) -> dict:
    model = pm.stage_model
    return {
        "weights": {layer.name: layer.get_weights() for layer in model.layers
                    if not isinstance(layer, keras.layers.InputLayer)},
        "optimizer": optimizer_state(pm._tnt_stage.optimizer, model),
    }


def serial_model_from_config(pm) -> keras.Model:
    """A new serial model from the config kept at construction (Keras' from_config consumes
    the dict it is given, so it gets a copy)."""
    cls, config = pm._tnt_serial_config
    return cls.from_config(copy.deepcopy(config))


def gather_serial_model(pm, with_optimizer: bool = True) -> keras.Model | None:
    """The whole serial model, filled from all stages, on the master; None elsewhere."""
    transport = pm._tnt_stage.transport
    if transport.replica != 0:
        return None
    payload = _stage_payload(pm)
    if transport.stage != 0:
        for request in _send_object(transport, payload, 0, transport.stage):
            request.wait()
        return None
    payloads = [payload] + [_recv_object(transport, s, s) for s in range(1, transport.num_stages)]
    with tnt_comm.long_local_work():  # the others wait in save_on_master's barrier meanwhile
        return _filled_serial_model(pm, payloads, with_optimizer)


def _filled_serial_model(pm, payloads: list[dict], with_optimizer: bool) -> keras.Model:
    full = serial_model_from_config(pm)
    weights = {}
    for p in payloads:
        weights.update(p["weights"])
    for layer in full.layers:
        if layer.name in weights:
            layer.set_weights(weights[layer.name])
    args = pm._tnt_compile_args
    if with_optimizer and args is not None:
        optimizer = clone_optimizer(args["optimizer"])
        full.compile(optimizer=optimizer, loss=args["loss"], metrics=args["metrics"],
                     loss_weights=args["loss_weights"], weighted_metrics=args["weighted_metrics"])
        state = {}
        for p in reversed(payloads):  # stage 0's iterations/learning rate win
            state.update(p["optimizer"])
        if state:
            assign_optimizer_state(optimizer, full, state)
    return full


def save_pipelined(pm, filepath, **kwargs) -> None:
    full = gather_serial_model(pm)
    _io.save_on_master(filepath, lambda tmp: full.save(tmp, overwrite=True, **kwargs))


def save_pipelined_weights(pm, filepath, **kwargs) -> None:
    full = gather_serial_model(pm, with_optimizer=False)
    _io.save_on_master(filepath, lambda tmp: full.save_weights(tmp, overwrite=True, **kwargs))


def load_pipelined_weights(pm, filepath) -> None:
    """Load a serial weights file: this rank reads its stage's layers (and optimizer) only."""
    with deferred_variables():  # the whole model's shapes, for the file's layout only
        full = serial_model_from_config(pm)
    optimizer = pm._tnt_compile_args["optimizer"] if pm._tnt_stage.optimizer is not None else None
    with _stage_file(filepath) as (local, archive):
        read_stage_state(pm, full, optimizer, _internals.weights_store(local, archive))


def read_stage_state(pm, full: keras.Model, full_optimizer, store) -> None:
    """Fill this rank's stage (and its optimizer) from ``store``, a file of the serial model.

    ``full`` describes the serial model (deferred: shapes only), ``full_optimizer`` its
    optimizer (built or not: only its configuration is used); only the groups of this
    stage's layers and the optimizer variables of its weights are read.
    """
    paths = _internals.saved_layer_paths(full)
    for layer in pm.stage_model.layers:
        if layer.weights:
            _internals.load_layer_state(layer, store, paths[layer.name])
    optimizer = pm._tnt_stage.optimizer
    if full_optimizer is None or optimizer is None:
        return
    group = store.get("optimizer")
    if not len(group):
        return  # saved without optimizer state
    if not optimizer.built:
        optimizer.build(pm.stage_model.trainable_variables)
    mine = dict(zip(optimizer_keys(optimizer, pm.stage_model), optimizer.variables))
    for k, key in enumerate(serial_optimizer_keys(full_optimizer, full)):
        if key in mine:
            mine[key].assign(np.asarray(group[str(k)]))


@contextlib.contextmanager
def _stage_file(filepath):
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


def _deferred_from_file(archive, custom_objects, compile: bool, safe_mode: bool) -> keras.Model:
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


def load_model(filepath, *, parallel_strategy, num_pipeline_stages=None, num_micro_batches=None,
               pipeline_schedule: str = "1f1b", custom_objects=None, compile: bool = True,
               safe_mode: bool = True, **kwargs):
    """Load a ``.keras`` file (pipelined or serial save) into ``num_pipeline_stages`` stages.

    Each rank builds the model's shapes only (deferred variables), plans the stages, and
    reads its own stage's weights and optimizer variables from the file.
    """
    from .._model import Model
    from ._model import PipelinedModel

    strategy = getattr(parallel_strategy, "value", parallel_strategy)
    with _stage_file(filepath) as (local, archive):
        legacy = archive is None  # an HDF5 (.h5) model: Keras loads it whole
        full = keras.saving.load_model(local, custom_objects=custom_objects, compile=compile, **kwargs) \
            if legacy else _deferred_from_file(archive, custom_objects, compile, safe_mode)
        pipeline_plan = make_plan(full, num_pipeline_stages,
                                  use_markers=_markers_agree(full, num_pipeline_stages))
        if _runtime.get_size() == 1 or pipeline_plan.num_stages == 1:
            if not legacy:
                full = keras.saving.load_model(archive.filename, custom_objects=custom_objects,
                                               compile=compile, safe_mode=safe_mode, **kwargs)
            return Model(full)  # one rank or one stage: data parallelism
        model = PipelinedModel(full, parallel_strategy=strategy, num_micro_batches=num_micro_batches,
                               pipeline_schedule=pipeline_schedule, pipeline_plan=pipeline_plan)
        if not legacy:
            full_optimizer = full.optimizer if compile and getattr(full, "optimizer", None) is not None else None
            read_stage_state(model, full, full_optimizer, _internals.weights_store(local, archive))
    del full
    return model


def _markers_agree(model, num_pipeline_stages) -> bool:
    """Use the file's SplitLayers unless the caller asks for another number of stages."""
    if num_pipeline_stages is None:
        return True
    graph = model_graph(model)
    if not any(isinstance(c.layer, SplitLayer) for c in graph.calls):
        return True
    return max(stages_from_markers(graph)) + 1 == num_pipeline_stages
