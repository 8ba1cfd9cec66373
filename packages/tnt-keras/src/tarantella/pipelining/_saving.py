"""Save a pipelined model as one ordinary Keras file; load a file into any number of stages.

Saving (``streamed_save``): the master (stage 0 of replica 0) writes the file array by
array (``_core.streamed_files``): it builds the serial model from its config with deferred
variables (shapes, no memory), replays Keras' save walk of it, and for each variable asks
the stage holding it (replica 0's; sharded replicas first join their stage's optimizer
state on replica 0) in a point-to-point message, writes it and drops it. No rank holds
more than its own stage plus one variable; the file is the one Keras' own ``save`` /
``save_weights`` writes of the serial model (atomically, ``_io.save_on_master``).
``gather_serial_model`` (the whole serial model on the master) remains for ``export`` and
for what a streamed save does not cover (extra ``save`` arguments, a layer saving assets or
computed values).

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
import functools
import warnings

import keras
import numpy as np

import tnt_comm

from .._core import array_requests as _requests
from .._core import internals as _internals
from .._core import runtime as _runtime
from .._core import streamed_files as _streamed
from .._core.deferred import deferred_variables, is_deferred
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

#: Header "step" of a gather's messages (never a training step number; a stream's:
#: ``array_requests.STREAM_STEP``).
_SAVE_STEP = 2**30


# -- streamed save ----------------------------------------------------------------------------
class _StageHoldings:
    """What this rank's stage holds of the serial file, read one array at a time (no copy
    of the stage is made; a sharded stage's optimizer state is joined on replica 0 first)."""

    def __init__(self, pm, with_optimizer: bool) -> None:
        model = pm.stage_model
        self.layers = {layer.name: layer for layer in held_layers(model)
                       if not isinstance(layer, keras.layers.InputLayer)}
        stage = pm._tnt_stage
        optimizer = stage.optimizer if with_optimizer else None
        self.optimizer_built = optimizer is not None and optimizer.built
        self.optimizer: dict = {}
        if self.optimizer_built and stage.shards is not None:
            # Collective over the replica group: the stage's whole state on replica 0.
            self.optimizer = stage.whole_optimizer_state() or {}
        elif self.optimizer_built:
            self.optimizer = {key: var for key, var in zip(optimizer_keys(optimizer, model), optimizer.variables)
                              if not is_deferred(var)}

    def get(self, request: _streamed.Request) -> np.ndarray | None:
        """The array ``request`` names, viewing the variable's memory where it can (None:
        this stage has none)."""
        if isinstance(request, _streamed.Weight):
            layer = self.layers.get(request.layer)
            value = None if layer is None else layer.weights[request.index]
        else:
            value = self.optimizer.get(request.key)
        if value is None or isinstance(value, np.ndarray):
            return value
        return _streamed.variable_view(value)


class StreamedStages:
    """A streamed save of a pipelined model (see ``_core.streamed_files``): the master
    writes, replica 0's other stages answer its requests one array at a time."""

    def __init__(self, pm, kind: str, holdings: _StageHoldings, full: keras.Model | None,
                 events: list[tuple] | None) -> None:
        self.transport = pm._tnt_stage.transport
        self.kind = kind
        self.holdings = holdings
        self.full = full
        self.events = events

    # -- off the master: stage s of replica 0 ---------------------------------------------------
    def serve(self) -> None:
        """Send this stage's layer names, then answer the master's requests until it says
        it is done (nothing on other replicas, nor on the master)."""
        t = self.transport
        if t.replica != 0 or t.stage == 0:
            return
        for request in _requests.send_object(t, sorted(self.holdings.layers), 0, 0):
            request.wait()
        _requests.serve(t, 0, self.holdings.get)  # each array is freed before the next

    # -- on the master ----------------------------------------------------------------------------
    def write(self, path: str) -> None:
        """Write the file at ``path``, asking the other stages for their arrays; they are
        told to stop whatever happens here."""
        t = self.transport
        asker = _requests.Asker(t, range(1, t.num_stages))
        try:
            owner = {name: 0 for name in self.holdings.layers}
            for stage in range(1, t.num_stages):
                for name in _requests.recv_object(t, stage, 0):
                    owner.setdefault(name, stage)  # a tied layer: its first holder
            fetch = functools.partial(self._fetch, owner=owner, asker=asker)
            _streamed.write(self.kind, path, self.full, self.events, fetch)
        finally:
            asker.stop()

    def _fetch(self, request: _streamed.Request, owner: dict[str, int],
               asker: _requests.Asker) -> np.ndarray | None:
        layer = request.layer
        stage = 0 if layer is None else owner.get(layer)
        if stage is None:
            return None
        if stage == 0:
            return self.holdings.get(request)
        return asker.ask(stage, request)


def streamed_save(pm, kind: str, with_optimizer: bool) -> StreamedStages | None:
    """A streamed save (``kind``: "model" for .keras, "weights" for .weights.h5) of ``pm``,
    or None when the serial model cannot be streamed (then gather it). Every rank calls it;
    collective (the decision is the master's; sharded stages join their optimizer state)."""
    args = pm._tnt_compile_args
    with_optimizer = with_optimizer and args is not None
    holdings = _StageHoldings(pm, with_optimizer)
    full = events = None
    if _runtime.is_master_rank():
        full = serial_model_from_config(pm, deferred=True)
        optimizer = None
        if with_optimizer:
            optimizer = args["optimizer"]
            full.compile(optimizer=clone_optimizer(optimizer), loss=args["loss"], metrics=args["metrics"],
                         loss_weights=args["loss_weights"], weighted_metrics=args["weighted_metrics"])
        events = _streamed.save_events(full, optimizer, holdings.optimizer_built)
    if not _streamed.events_on_every_rank(events):
        return None
    return StreamedStages(pm, kind, holdings, full, events)


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
        for request in _requests.send_object(transport, payload, 0, transport.stage, _SAVE_STEP):
            request.wait()
        return None
    payloads = [payload] + [_requests.recv_object(transport, s, s, _SAVE_STEP) for s in range(1, transport.num_stages)]
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
