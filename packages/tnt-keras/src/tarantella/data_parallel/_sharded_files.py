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


@contextlib.contextmanager
def serial_optimizer(model: keras.Model, sharding, gather: bool) -> Iterator[object | None]:
    """While inside, ``model.optimizer`` on rank 0 of the replica group (``sharding.comm``:
    the master for DATA, replica 0 of each tensor shard for tensor groups) is one built on
    every trainable variable; with ``gather`` it holds every replica's state (collective
    over the group: every rank enters). Yields it (None on the other ranks)."""
    sharded = model.optimizer
    if sharded is None or not sharded.built:
        yield None
        return
    comm = sharding.comm
    master = comm.rank == 0
    full = None
    order = None
    if master:
        full = _serial_copy(sharded)
        full.build(model.trainable_variables)
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
    if master:
        model.optimizer = full
    try:
        yield full
    finally:
        if master:
            model.optimizer = sharded


def load_into(model: keras.Model, sharding, load) -> None:
    """Run ``load()`` (Keras reading a serial file into ``model``) with a serial optimizer in
    place, then keep the owned slots. Every rank briefly holds the whole state it reads."""
    sharded = model.optimizer
    if sharded is None or not sharded.built:
        load()
        return
    full = _serial_copy(sharded)
    full.build(model.trainable_variables)
    model.optimizer = full
    try:
        load()
    finally:
        model.optimizer = sharded
    values = _by_name(full)
    for name, v in _by_name(sharded).items():
        v.assign(values[name])
