"""Files of a sharded model: ordinary Keras files with the whole optimizer state.

Saving builds, on rank 0 of the replica group only (the master for DATA; replica 0 of each
tensor shard for data replicas of tensor groups), a serial optimizer (built on every
trainable variable, as serial Keras builds it) and fills it one optimizer variable at a
time from the replica that holds it (a broadcast from its owner), so no other rank ever
holds the whole state of its group.
Loading (a file written at any number of ranks or level) reads the serial state, then keeps
only the owned variables' slots (:func:`reshard`), matched by the slot's name (Keras names
a slot after its variable's path, e.g. ``dense_kernel_momentum``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import numpy as np


def _serial_copy(optimizer):
    """A fresh, unbuilt optimizer of the same class and configuration."""
    return keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))


def _by_name(optimizer) -> dict[str, object]:
    out: dict[str, object] = {}
    for v in optimizer.variables:
        if v.name in out:
            raise ValueError(f"sharded optimizer state: two optimizer variables are named {v.name!r}; "
                             "give the model's layers unique names.")
        out[v.name] = v
    return out


def reshard(model: keras.Model, sharding) -> None:
    """Replace ``model``'s optimizer, built on every variable (a loaded file), by one built
    on the owned variables with the same values (local: every rank read the same file)."""
    full = model.optimizer
    sharded = _serial_copy(full)
    sharding.install(sharded)
    sharded.build(model.trainable_variables)  # the owned ones (install)
    values = _by_name(full)
    for name, v in _by_name(sharded).items():
        v.assign(values[name])
    model.optimizer = sharded


def _whole_state(sharded, variables, comm, gather: bool):
    """On rank 0 of ``comm``: a serial copy of ``sharded`` built on all of ``variables``
    (with ``gather``: every replica's state, one broadcast per optimizer variable from the
    replica holding it; a collective, every rank enters). None on the other ranks."""
    master = comm.rank == 0
    full = None
    order = None
    if master:
        full = _serial_copy(sharded)
        full.build(variables)
        order = [(v.name, tuple(v.shape), np.dtype(v.dtype).str) for v in full.variables]
    order = comm.broadcast_object(order, 0)
    mine = _by_name(sharded)
    holders = comm.allgather_object(sorted(mine))
    if gather:
        targets = _by_name(full) if master else {}
        for name, shape, dtype in order:
            root = next((r for r, names in enumerate(holders) if name in names), None)
            if root is None:
                raise ValueError(f"sharded optimizer state: no replica holds {name!r}")
            buf = np.asarray(mine[name].numpy()) if comm.rank == root else np.empty(shape, np.dtype(dtype))
            value = comm.broadcast(np.ascontiguousarray(buf.reshape(-1)), root)
            if master:
                targets[name].assign(value.reshape(shape))
    return full


def _holding(model: keras.Model, optimizer) -> list[str]:
    """The names of ``model``'s attributes that hold ``optimizer`` (a GAN's ``d_optimizer``):
    what Keras' saving writes it under."""
    return [name for name, value in vars(model).items() if value is optimizer and name != "optimizer"]


def _sharded_optimizers(model: keras.Model, sharding) -> list[tuple[object, list, list[str]]]:
    """(optimizer, the variables it is built for, the model attributes naming it) of every
    built sharded optimizer: the compiled one and those of a user's own ``train_step``."""
    out = []
    if model.optimizer is not None and model.optimizer.built:
        out.append((model.optimizer, model.trainable_variables, ["optimizer"]))
    for optimizer, shards in sharding.own_step_optimizers():
        names = _holding(model, optimizer)
        if optimizer.built and names:
            out.append((optimizer, shards.variables, names))
    return out


@contextlib.contextmanager
def _swapped(model: keras.Model, swaps: list[tuple[list[str], object, object]]) -> Iterator[None]:
    """While inside, each listed attribute of ``model`` holds its replacement."""
    for names, _, replacement in swaps:
        for name in names:
            setattr(model, name, replacement)
    try:
        yield
    finally:
        for names, original, _ in swaps:
            for name in names:
                setattr(model, name, original)


@contextlib.contextmanager
def serial_optimizer(model: keras.Model, sharding, gather: bool) -> Iterator[object | None]:
    """While inside, every sharded optimizer of ``model`` on rank 0 of the replica group
    (``sharding.comm``: the master for DATA, replica 0 of each tensor shard for tensor
    groups) is one built on all the variables it updates — ``model.optimizer`` and those a
    user's own ``train_step`` applies (a GAN's ``d_optimizer``, under the attribute Keras
    saves it by); with ``gather`` each holds every replica's state (collective over the
    group: every rank enters). Yields the compiled one's serial copy (None on other ranks)."""
    comm = sharding.comm
    swaps = []
    for optimizer, variables, names in _sharded_optimizers(model, sharding):
        full = _whole_state(optimizer, variables, comm, gather)
        if full is not None:
            swaps.append((names, optimizer, full))
    with _swapped(model, swaps):
        yield next((full for names, _, full in swaps if "optimizer" in names), None)


def load_into(model: keras.Model, sharding, load) -> None:
    """Run ``load()`` (Keras reading a serial file into ``model``) with serial optimizers in
    place (the compiled one and those of an own ``train_step``), then keep the owned slots.
    Every rank briefly holds the whole state it reads."""
    swaps = []
    for optimizer, variables, names in _sharded_optimizers(model, sharding):
        full = _serial_copy(optimizer)
        full.build(variables)
        swaps.append((names, optimizer, full))
    with _swapped(model, swaps):
        load()
    for _, sharded, full in swaps:
        values = _by_name(full)
        for name, v in _by_name(sharded).items():
            v.assign(values[name])
