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

import copy
import pickle
import warnings

import keras
import numpy as np

import tnt_comm

from .._core import internals as _internals
from .._core.deferred import deferred_variables
from .._core.graph import leaf_layers
from .._core.serial_files import (
    assign_optimizer_state,
    clone_optimizer,
    open_model_file,
    optimizer_keys,
    optimizer_state,
    serial_optimizer_keys,
    variable_keys,
)
from ._stages import held_layers

#: Header "step" of save messages (never a training step number).
_SAVE_STEP = 2**30


def _send_object(transport, obj, stage: int, tag: int) -> list:
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    length = np.array([data.size], dtype=np.int64)
    return [transport.isend(length, stage, (_SAVE_STEP, 0, tag)),
            transport.isend(data, stage, (_SAVE_STEP, 1, tag))]


def _recv_object(transport, stage: int, tag: int):
    length = int(transport.recv(stage, (_SAVE_STEP, 0, tag), np.int64, (1,))[0])
    data = transport.recv(stage, (_SAVE_STEP, 1, tag), np.uint8, (length,))
    return pickle.loads(data.tobytes())


def stage_payload(pm, with_optimizer: bool = True, state: dict | None = None) -> dict:
    """This stage's weights by layer name (and optimizer state by key, if asked: ``state``
    when given, the stage's whole state gathered from sharded replicas)."""
    model = pm.stage_model
    if state is None:
        state = optimizer_state(pm._tnt_stage.optimizer, model) if with_optimizer else {}
    return {
        "weights": {layer.name: layer.get_weights() for layer in held_layers(model)
                    if not isinstance(layer, keras.layers.InputLayer)},
        "optimizer": state,
    }


def serial_weight_keys(pm) -> list[tuple[str, tuple[int, ...]]]:
    """("<layer>/<weight index>", shape) of each of the serial model's weights, in its
    ``get_weights()`` order (from its config, with deferred variables: no memory)."""
    full = serial_model_from_config(pm, deferred=True)
    keys = variable_keys(full)
    return [(keys[id(w)], tuple(int(d) for d in w.shape)) for w in full.weights]


def serial_model_from_config(pm, deferred: bool = False) -> keras.Model:
    """A new serial model from the config kept at construction (Keras' from_config consumes
    the dict it is given, so it gets a copy); ``deferred``: shapes only, no memory."""
    cls, config = pm._tnt_serial_config
    if deferred:
        with deferred_variables():
            return cls.from_config(copy.deepcopy(config))
    return cls.from_config(copy.deepcopy(config))


def gather_serial_model(pm, with_optimizer: bool = True) -> keras.Model | None:
    """The whole serial model, filled from all stages, on the master; None elsewhere."""
    transport = pm._tnt_stage.transport
    # Sharded replicas: their slots to replica 0 of the stage first (collective over the group).
    state = pm._tnt_stage.whole_optimizer_state() if with_optimizer else {}
    if transport.replica != 0:
        return None
    payload = stage_payload(pm, state=state)
    if transport.stage != 0:
        for request in _send_object(transport, payload, 0, transport.stage):
            request.wait()
        return None
    payloads = [payload] + [_recv_object(transport, s, s) for s in range(1, transport.num_stages)]
    with tnt_comm.long_local_work():  # the others wait in save_on_master's barrier meanwhile
        return fill_serial_model(pm, payloads, with_optimizer)


def fill_serial_model(pm, payloads: list[dict], with_optimizer: bool) -> keras.Model:
    full = serial_model_from_config(pm)
    weights = {}
    for p in payloads:
        weights.update(p["weights"])
    for layer in leaf_layers(full):  # nested models' layers too; a tied layer once
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


def load_pipelined_weights(pm, filepath) -> None:
    """Load a serial weights file: this rank reads its stage's layers (and optimizer) only."""
    with deferred_variables():  # the whole model's shapes, for the file's layout only
        full = serial_model_from_config(pm)
    optimizer = pm._tnt_compile_args["optimizer"] if pm._tnt_stage.optimizer is not None else None
    with open_model_file(filepath) as (local, archive):
        read_stage_state(pm, full, optimizer, _internals.weights_store(local, archive))


def read_stage_state(pm, full: keras.Model, full_optimizer, store) -> None:
    """Fill this rank's stage (and its optimizer) from ``store``, a file of the serial model.

    ``full`` describes the serial model (deferred: shapes only), ``full_optimizer`` its
    optimizer (built or not: only its configuration is used); only the groups of this
    stage's layers and the optimizer variables of its weights are read.
    """
    paths = _internals.saved_layer_paths(full)
    for layer in held_layers(pm.stage_model):
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
    keys = serial_optimizer_keys(full_optimizer, full)
    if len(group) != len(keys):
        # The file's optimizer was never built (saved before training) or is another one:
        # Keras' own loading skips the optimizer's state then, with this warning.
        warnings.warn(f"Skipping variable loading for optimizer '{optimizer.name}', because it has "
                      f"{len(keys)} variables whereas the saved optimizer has {len(group)} variables.",
                      stacklevel=2)
        return
    mine = dict(zip(optimizer_keys(optimizer, pm.stage_model), optimizer.variables))
    for k, key in enumerate(keys):
        if key in mine:
            mine[key].assign(np.asarray(group[str(k)]))
