"""Make every replica start from the master rank's state.

Ranks are compared first (names, shapes and dtypes of every variable), so that a model
built differently on some rank is reported by name instead of corrupting a broadcast or
hanging in it, together with a digest of each variable's bytes; then the master's values
of the variables whose digest differs somewhere are broadcast, one buffer per dtype.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

import keras
import numpy as np

import tnt_comm

from . import internals as _internals
from .internals import all_layers
from .runtime import MASTER_RANK
from .shard_buckets import cut_into_buckets
from .step_parts import overrides, split_sizes


class ReplicaMismatchError(RuntimeError):
    """The model (or optimizer) differs between ranks."""


def _signature(variables: Sequence) -> list[tuple[tuple[int, ...], str]]:
    # Names are not compared: Keras numbers auto-named layers per process, so the same
    # model may be `dense_4` on one rank and `dense_2` on another. Order, shape and
    # dtype must agree; names only make the error readable.
    return [(tuple(int(d) for d in v.shape), str(v.dtype)) for v in variables]


def _mismatch_error(what: str, everyone: list, rank: int) -> ReplicaMismatchError:
    """The error naming the first variable of ``rank`` that differs from the master's."""
    reference, ref_names = everyone[MASTER_RANK][:2]
    theirs, names = everyone[rank][:2]
    if len(theirs) != len(reference):
        detail = f"rank {rank} has {len(theirs)} variables, rank 0 has {len(reference)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(theirs, reference)) if a != b)
        detail = (
            f"variable #{i} is {names[i]} {theirs[i][0]} {theirs[i][1]} on rank {rank} "
            f"but {ref_names[i]} {reference[i][0]} {reference[i][1]} on rank 0"
        )
    return ReplicaMismatchError(
        f"The {what} differs between ranks: {detail}. Every rank must build the same "
        "model (same layers, in the same order, same input shapes); make sure the model "
        "construction does not depend on the rank or on unseeded randomness."
    )


def _digest(variable) -> bytes:
    """A hash of the variable's bytes: equal digests on two ranks mean equal values, bit
    for bit (-0.0 and 0.0, NaN payloads included)."""
    flat = np.ascontiguousarray(variable.numpy()).reshape(-1)
    return hashlib.blake2b(flat.view(np.uint8).data, digest_size=16).digest()


def differing_from_master(groups: Sequence[tuple[str, Sequence]]) -> list[list[int]]:
    """For each ``(what, variables)`` group: the positions whose values differ from the
    master's on some rank (the same list on every rank), after checking that every rank
    has the same variables (:class:`ReplicaMismatchError` otherwise). One collective for
    all groups: names, shapes, dtypes and a digest of each variable's bytes, read one
    variable at a time (no copy of the model)."""
    mine = [(_signature(v), [x.path for x in v], [_digest(x) for x in v]) for _, v in groups]
    everyone = tnt_comm.allgather_object(mine)
    out = []
    for g, (what, _) in enumerate(groups):
        reference = everyone[MASTER_RANK][g]
        differ: set[int] = set()
        for rank, theirs in enumerate(everyone):
            if theirs[g][0] != reference[0]:
                raise _mismatch_error(what, [e[g] for e in everyone], rank)
            differ.update(i for i, (a, b) in enumerate(zip(theirs[g][2], reference[2])) if a != b)
        out.append(sorted(differ))
    return out


#: Bytes of one broadcast chunk: small variables travel together (few collectives), and no
#: rank ever holds more than one chunk (or one variable larger than it) in transit, instead
#: of a flat copy of the whole model (issue 29: 3 transient full copies before).
BROADCAST_CHUNK_BYTES = 16 * 2**20


def _np_dtype(variable) -> np.dtype:
    """The NumPy dtype of a Keras variable (bfloat16 and friends through TensorFlow)."""
    import tensorflow as tf

    return np.dtype(tf.as_dtype(str(variable.dtype)).as_numpy_dtype)


def _chunks(variables: Sequence, limit: int) -> list[list]:
    """Consecutive runs of same-dtype variables of at most ``limit`` bytes (a larger
    variable forms a run of its own): the sharded buckets' cut, per run of one dtype."""
    runs: list[list] = []
    for _, same in itertools.groupby(variables, key=lambda v: str(v.dtype)):
        same = list(same)
        nbytes = [int(np.prod(v.shape)) * _np_dtype(v).itemsize for v in same]
        runs += [[same[k] for k in bucket] for bucket in cut_into_buckets(range(len(same)), nbytes, limit)]
    return runs


def broadcast_from_master(variables: Sequence, comm=None) -> None:
    """Overwrite ``variables`` on every rank with the master rank's values, chunk by chunk
    into the variables (at most one chunk of BROADCAST_CHUNK_BYTES, or one variable, in
    flight), so that synchronising replicas costs no full copy of the model."""
    comm = comm if comm is not None else tnt_comm.world()
    root = comm.rank == MASTER_RANK
    for group in _chunks(list(variables), BROADCAST_CHUNK_BYTES):
        sizes = [int(np.prod(v.shape)) for v in group]
        dtype = _np_dtype(group[0])
        if root:
            flat = (np.asarray(group[0].numpy()).reshape(-1) if len(group) == 1
                    else np.concatenate([np.asarray(v.numpy()).reshape(-1) for v in group]))
        else:
            flat = np.empty(sum(sizes), dtype)
        flat = comm.broadcast(np.ascontiguousarray(flat), MASTER_RANK)
        if root:  # the master's variables hold these values already
            del flat
            continue
        offset = 0
        for var, n in zip(group, sizes):
            var.assign(flat[offset : offset + n].reshape(var.shape))
            offset += n
        del flat


def build_variables(model: keras.Model, wrapper: keras.Model, dataset, with_metrics: bool) -> None:
    """Create every variable (model, metrics, optimizer) before any step is traced.

    The step functions read and reduce metric and optimizer state, so these must exist on
    every rank before the first step, built from the element spec with a one-sample batch
    (no data is consumed). A model with its own steps and no forward pass of its own (a
    GAN of two sub-models) is left to build in its first step, as Keras does.
    """
    import tensorflow as tf


    optimizer = model.optimizer if model.compiled else None
    if (model.built and wrapper.built
            and (not with_metrics or all(getattr(m, "built", True) for m in model.metrics))
            and (not with_metrics or optimizer is None or optimizer.built)):
        return  # nothing left to create: skip the eager forward pass
    if overrides(model, "train_step") and type(model).call is keras.Model.call:
        return
    spec, _ = split_sizes(dataset.element_spec)

    def zeros(s):
        if not isinstance(s, tf.TensorSpec):
            return s
        shape = [1 if d is None else d for d in s.shape]
        return tf.zeros(shape, s.dtype)

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(tf.nest.map_structure(zeros, spec))
    outputs = _internals.call_output_specs(model) if model.built and wrapper.built else None
    if outputs is not None and any(None in tuple(t.shape)[1:] for t in keras.tree.flatten(outputs)):
        outputs = None  # a dynamic axis besides the batch (a sequence): only a forward pass knows it
    if outputs is not None:
        # A built functional model's outputs are known without running it: the metrics,
        # the loss and the optimizer are built from zeros of those shapes (values unused),
        # with as many rows as the batch the targets were made from.
        first = tf.nest.flatten(x)[0]
        rows = int(first.shape[0]) if first.shape.rank else 1
        y_pred = keras.tree.map_structure(lambda t: tf.zeros([rows, *tuple(t.shape)[1:]], t.dtype), outputs)
    else:
        y_pred = model(x, training=False)
        if not wrapper.built:
            wrapper(x, training=False)
    if with_metrics and model.compiled:
        if y is not None and _internals.has_compiled_loss(model):
            model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        model.reset_metrics()
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)


def sync_replicas(model: keras.Model, with_optimizer: bool = True, skip=None) -> None:
    """Check the ranks built the same model, then give every rank the master's state
    (``with_optimizer=False``: sharded replicas, each holding its own optimizer state).

    Only variables whose bytes differ from the master's on some rank are broadcast: a
    model seeded alike on every rank, or synchronised before and unchanged since (a
    recompile), costs one small collective; a rank-local ``set_weights`` in between
    is still found and overwritten. ``skip(variable)``: left out (sharding level 3: the
    variables this replica does not store)."""
    groups = [("model", [v for v in model.variables if skip is None or not skip(v)])]
    optimizer = model.optimizer if model.compiled else None
    if with_optimizer and optimizer is not None and optimizer.built:
        groups.append(("optimizer state", list(optimizer.variables)))
    for (_, variables), differ in zip(groups, differing_from_master(groups)):
        if differ:
            broadcast_from_master([variables[i] for i in differ])


def moving_statistics(model: keras.Model) -> list:
    """The non-trainable statistics each replica updates from its own micro-batches."""
    out = []
    for layer in all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            out += [layer.moving_mean, layer.moving_variance]
    return out


def average_moving_statistics(model: keras.Model, allreduce=None, size: int | None = None) -> None:
    """Replace every replica's batch-norm moving statistics by their mean over the replicas
    (``allreduce``: a SUM over them, default every rank; ``size``: how many they are).

    Each rank's BatchNormalization layers track the statistics of its own micro-batches,
    so replicas drift apart; averaging before evaluate, save, checkpoints and at the end
    of fit makes every rank (and every file) hold one model.
    """
    variables = moving_statistics(model)
    if not variables:
        return
    if allreduce is None:
        allreduce, size = (lambda a: tnt_comm.allreduce(a, tnt_comm.Op.SUM)), tnt_comm.size()
    flat = np.concatenate([np.asarray(v.numpy(), dtype=np.float64).reshape(-1) for v in variables])
    mean = allreduce(flat) / size
    offset = 0
    for var in variables:
        n = int(np.prod(var.shape))
        var.assign(mean[offset : offset + n].reshape(var.shape).astype(var.dtype))
        offset += n
