"""In-graph collectives on a tensor group, with the gradients layer parallelism needs.

A split layer's shards live on the ranks of one *tensor group*; three collectives join
their partial results, each a graph op (``tf.numpy_function`` calling the group's
blocking ``tnt_comm`` collective) with a custom gradient:

    copy_to_group     (f)  forward identity            backward SUM-allreduce
    reduce_from_group (g)  forward SUM-allreduce       backward identity
    gather_last_axis       forward allgather (last axis, rank order)
                           backward this rank's slice of the gradient

Every rank of a group must issue the same collectives in the same order. All ranks
trace the same graph, and each collective takes the previous one of its graph as an extra
input, so the executor runs them in creation order (forward in layer order, then backward
in reverse), whatever else could run in parallel. They are ``stateful=True``: never pruned,
never constant-folded by Grappler (cf. the start token of ``_reducer``), and not reordered
against each other. ``tf.numpy_function`` cannot live inside XLA: a tensor-parallel step
runs with ``jit_compile=False``.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tnt_comm

_last_collective: dict[int, tf.Tensor] = {}


class TensorGroup:
    """The ranks sharing one copy of every split layer (adjacent ranks of the job)."""

    def __init__(self, comm: tnt_comm.Communicator | None) -> None:
        self.comm = comm
        self.rank = comm.rank if comm is not None else 0
        self.size = comm.size if comm is not None else 1

    @classmethod
    def of_world(cls, tensor_parallel_size: int) -> TensorGroup:
        """Split the job's ranks into groups of ``tensor_parallel_size`` adjacent ranks."""
        world = tnt_comm.world()
        if world.size == 1:
            return cls(None)
        return cls(world.split(world.rank // tensor_parallel_size, world.rank))

    def __repr__(self) -> str:
        return f"<TensorGroup rank {self.rank} of {self.size}>"


def _ordered(fn, x: tf.Tensor, name: str) -> tf.Tensor:
    """``fn`` (numpy -> numpy, same dtype) as a graph op after the previous collective."""
    inputs = [x]
    graph = None
    if not tf.executing_eagerly():
        graph = tf.compat.v1.get_default_graph()
        prev = _last_collective.get(id(graph))
        if prev is not None and prev.graph is graph:
            inputs.append(prev)
    out = tf.numpy_function(lambda a, *_order: fn(np.ascontiguousarray(a)), inputs, x.dtype,
                            stateful=True, name=name)
    if graph is not None:
        _last_collective[id(graph)] = out
    return out


def _allreduce(group: TensorGroup, x: tf.Tensor, name: str) -> tf.Tensor:
    out = _ordered(lambda a: group.comm.allreduce(a, tnt_comm.Op.SUM), x, name)
    out.set_shape(x.shape)
    return out


def copy_to_group(x: tf.Tensor, group: TensorGroup) -> tf.Tensor:
    """f: the input of a column-split layer. Identity forward; the gradient of ``x`` is
    the SUM over the group of every shard's gradient (each shard saw all of ``x``)."""
    if group.size == 1:
        return x

    @tf.custom_gradient
    def f(t):
        return tf.identity(t), lambda dy: _allreduce(group, dy, "tnt_tp_f_backward")

    return f(x)


def reduce_from_group(x: tf.Tensor, group: TensorGroup) -> tf.Tensor:
    """g: the output of a row-split layer. SUM over the group forward; the gradient
    reaches every shard unchanged (each shard's partial sum counts once)."""
    if group.size == 1:
        return x

    @tf.custom_gradient
    def g(t):
        return _allreduce(group, t, "tnt_tp_g_forward"), lambda dy: tf.identity(dy)

    return g(x)


def gather_last_axis(x: tf.Tensor, group: TensorGroup) -> tf.Tensor:
    """The group's shards of the last axis concatenated in rank order (every shard as
    wide as this one's); the gradient is this rank's slice of the incoming one."""
    if group.size == 1:
        return x
    width = x.shape[-1]

    def gather(a: np.ndarray) -> np.ndarray:
        whole = group.comm.allgather(np.ascontiguousarray(np.moveaxis(a, -1, 0)))
        return np.ascontiguousarray(np.moveaxis(whole, 0, -1))

    @tf.custom_gradient
    def gathered(t):
        out = _ordered(gather, t, "tnt_tp_allgather")
        out.set_shape(t.shape[:-1].concatenate([width * group.size]))

        def grad(dy):
            start = group.rank * width
            return dy[..., start:start + width]

        return out, grad

    return gathered(x)
