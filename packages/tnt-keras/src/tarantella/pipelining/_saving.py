"""Save a pipelined model as one ordinary Keras file; load a file into any number of stages.

Saving: the stages of replica 0 send their layers' weights and optimizer state to the
master (stage 0 of replica 0) over point-to-point messages; the master rebuilds the serial
model from its config, fills it, compiles it with a fresh optimizer holding the gathered
state and writes it with Keras' own ``save`` (atomically, ``_io.save_on_master``). Only
the master holds the whole model, and only while writing.

Loading: every rank opens the master's copy of the file (``_io.master_file``), builds
the Keras model, and ``PipelinedModel`` keeps the clones of its stage's layers (with the
optimizer state of its variables); the full model is then dropped. The stage count is
free: q stages from a file saved with p, or saved serially.

Optimizer variables are matched by the model variable they belong to, named
``"<layer>/<index of the weight in the layer>"`` plus the slot's name (Keras names slots
after the variable's path, which differs between a stage model and the serial model).
"""

from __future__ import annotations

import pickle

import keras
import numpy as np

import tnt_comm

from .. import _io, _runtime
from ..keras._split_layer import SplitLayer
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


def optimizer_state(optimizer, model: keras.Model) -> dict[str, np.ndarray]:
    """The optimizer's variables by model-independent key (see module docstring)."""
    if optimizer is None or not optimizer.built:
        return {}
    keys = _variable_keys(model)
    prefixes = sorted(((v.path.replace("/", "_"), keys[id(v)]) for v in model.trainable_variables
                       if id(v) in keys), key=lambda p: -len(p[0]))
    out = {}
    for var in optimizer.variables:
        name = var.name
        key = name
        for prefix, vkey in prefixes:
            if name.startswith(prefix + "_"):
                key = f"{vkey}|{name[len(prefix) + 1:]}"
                break
        out[key] = np.asarray(var.numpy())
    return out


def assign_optimizer_state(optimizer, model: keras.Model, state: dict[str, np.ndarray]) -> int:
    """Assign ``state`` to the (built) optimizer's matching variables; returns how many."""
    if not state:
        return 0
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    mine = optimizer_state(optimizer, model)
    by_key = dict(zip(mine.keys(), optimizer.variables))
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
    cls, config = pm._tnt_serial_config
    full = cls.from_config(config)
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


def load_pipelined_weights(pm, local_path: str) -> None:
    """Load a serial weights file: this rank keeps its stage's layers' weights."""
    cls, config = pm._tnt_serial_config
    full = cls.from_config(config)
    full.load_weights(local_path)
    for layer in pm.stage_model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        layer.set_weights(full.get_layer(layer.name).get_weights())


def load_model(filepath, *, parallel_strategy, num_pipeline_stages=None, num_micro_batches=None,
               pipeline_schedule: str = "1f1b", custom_objects=None, compile: bool = True, **kwargs):
    """Load a ``.keras`` file (pipelined or serial save) into ``num_pipeline_stages`` stages."""
    from .._model import Model
    from ._model import PipelinedModel

    strategy = getattr(parallel_strategy, "value", parallel_strategy)
    with _io.master_file(filepath) as local:
        full = keras.saving.load_model(local, custom_objects=custom_objects, compile=compile, **kwargs)
    pipeline_plan = make_plan(full, num_pipeline_stages, use_markers=_markers_agree(full, num_pipeline_stages))
    if _runtime.get_size() == 1 or pipeline_plan.num_stages == 1:
        return Model(full)  # one rank or one stage: data parallelism
    model = PipelinedModel(full, parallel_strategy=strategy, num_micro_batches=num_micro_batches,
                           pipeline_schedule=pipeline_schedule, pipeline_plan=pipeline_plan)
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
