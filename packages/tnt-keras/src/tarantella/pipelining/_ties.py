"""Tied weights across stages: one logical variable, its gradients summed every step.

A layer called on several stages (GPT2CausalLM's token embedding: the lookup on stage 0,
the output projection on the last stage) is cloned on each of them (``Plan.ties``). The
first stage's copy is the master, the others replicas. They start equal (copied from one
layer); every step each holder sends its gradient of the layer's variables to the other
holders (after the replica reduction) and all of them add the contributions in stage
order, so every copy gets the very same gradient (bitwise) and the same optimizer update:
they never drift, as Megatron keeps its tied embeddings. The sum is the gradient serial
Keras computes for the one variable (its two uses' contributions); slices of two lookups
stay slices (concatenated in stage order), a lookup's slices meet a projection's dense
gradient densely, as TensorFlow aggregates them in serial Keras.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from .._core import sparse as _sparse
from ._plan import Plan
from ._stages import held_layers
from ._transport import Transport

#: Header "micro-batch" field of tie messages (beyond any micro-batch index).
_TIE_MICRO = 1 << 20


class TiedGradients:
    """The tied variables of one stage and the exchange of their gradients."""

    def __init__(self, plan: Plan, model: keras.Model, transport: Transport) -> None:
        self.transport = transport
        stage = transport.stage
        position = {id(v): i for i, v in enumerate(model.trainable_variables)}
        layers = {layer.name: layer for layer in held_layers(model)}
        # (running index over all tied variables, holders, position in this stage's variables)
        self.entries: list[tuple[int, tuple[int, ...], int]] = []
        self.replica_positions: set[int] = set()  # variables this stage holds as a replica
        originals = {c.layer.name: c.layer for c in plan.graph.calls}
        j = 0
        for tie in plan.ties:
            count = len(originals[tie.layer].trainable_weights)  # the same on every stage
            if stage in tie.stages:
                for k, v in enumerate(layers[tie.layer].trainable_weights):
                    self.entries.append((j + k, tie.stages, position[id(v)]))
                    if stage != tie.stages[0]:
                        self.replica_positions.add(position[id(v)])
            j += count

    def __bool__(self) -> bool:
        return bool(self.entries)

    def positions(self) -> set[int]:
        """This stage's positions (in its trainable variables) of tied variables."""
        return {pos for _, _, pos in self.entries}

    def sum(self, grads: list, step: int) -> list:
        """``grads`` with every tied variable's gradient replaced by the sum over its holders."""
        t, me = self.transport, self.transport.stage
        grads = list(grads)
        sends = []
        for j, holders, pos in self.entries:
            g = grads[pos]
            parts = _as_arrays(g)
            for peer in holders:
                if peer != me:
                    for part, array in enumerate(parts):
                        sends.append(t.isend(array, peer, (step, _TIE_MICRO + j, part)))
        for j, holders, pos in self.entries:
            mine = grads[pos]
            contributions = []
            for peer in holders:
                if peer == me:
                    contributions.append(mine)
                    continue
                meta = t.recv(peer, (step, _TIE_MICRO + j, 0), np.int64, (2,))
                shape = tuple(int(d) for d in mine.dense_shape) if _sparse.is_sparse(mine) \
                    else tuple(mine.shape)
                dtype = np.dtype((mine.values if _sparse.is_sparse(mine) else mine).dtype.as_numpy_dtype)
                if meta[0]:  # slices: indices, values
                    rows = int(meta[1])
                    idx = t.recv(peer, (step, _TIE_MICRO + j, 1), np.int64, (rows,))
                    val = t.recv(peer, (step, _TIE_MICRO + j, 2), dtype, (rows, *shape[1:]))
                    contributions.append(tf.IndexedSlices(tf.constant(val), tf.constant(idx),
                                                          tf.constant(shape, tf.int64)))
                else:
                    contributions.append(tf.constant(t.recv(peer, (step, _TIE_MICRO + j, 1), dtype, shape)))
            if all(_sparse.is_sparse(c) for c in contributions):
                contributions = [tf.IndexedSlices(c.values, tf.cast(c.indices, tf.int64), c.dense_shape)
                                 for c in contributions]
                grads[pos] = _sparse.concat(contributions)
            else:
                total = None
                for c in contributions:  # stage order on every holder: bitwise the same sum
                    c = tf.convert_to_tensor(c)
                    total = c if total is None else total + c
                grads[pos] = total
        for request in sends:
            request.wait()
        return grads


def _as_arrays(g) -> list[np.ndarray]:
    """The messages of one gradient: [meta (sparse?, rows), dense] or [meta, indices, values]."""
    if _sparse.is_sparse(g):
        idx = np.asarray(g.indices).astype(np.int64)
        return [np.array([1, idx.size], np.int64), idx, np.asarray(g.values)]
    return [np.array([0, 0], np.int64), np.asarray(g)]
