"""In-graph collectives on a tensor group, with the gradients layer parallelism needs.

A split layer's shards live on the ranks of one *tensor group*; three collectives join
their partial results, each a graph op (``tarantella._graph_collectives``: a native op
calling the group's blocking ``tnt_comm`` collective, or its ``tf.numpy_function``
fallback) with a custom gradient:

    copy_to_group     (f)  forward identity            backward SUM-allreduce
    reduce_from_group (g)  forward SUM-allreduce       backward identity
    gather_last_axis       forward allgather (last axis, rank order)
                           backward this rank's slice of the gradient

Every rank of a group must issue the same collectives in the same order. All ranks
trace the same graph, and each collective takes the previous one of its graph as an extra
input, so the executor runs them in creation order (forward in layer order, then backward
in reverse), whatever else could run in parallel. They are ``stateful=True``: never pruned,
never constant-folded by Grappler (cf. the start token of ``_reducer``), and not reordered
against each other. Neither op can live inside XLA: a tensor-parallel step is never one
XLA cluster (with ``jit_compile=True``, XLA compiles the segments between them: ``_xla``).
"""

from __future__ import annotations

import tensorflow as tf

import tnt_comm

from .._core import graph_collectives as _graph_collectives
from .._core.mesh import Mesh, groups

#: The order chain of every tensor-group collective (see _graph_collectives).
_CHAIN = "tensor_group"


class TensorGroup:
    """The ranks sharing one copy of every split layer (adjacent ranks of the job)."""

    def __init__(self, comm: tnt_comm.Communicator | None) -> None:
        self.comm = comm
        self.rank = comm.rank if comm is not None else 0
        self.size = comm.size if comm is not None else 1

    @classmethod
    def of_world(cls, tensor_parallel_size: int) -> TensorGroup:
        """The job's ranks in groups of ``tensor_parallel_size`` adjacent ranks (the mesh's
        tensor groups, shared with every model of that layout)."""
        world = tnt_comm.world()
        return cls(groups(Mesh(world.size, tensor_parallel_size)).tensor)

    def __repr__(self) -> str:
        return f"<TensorGroup rank {self.rank} of {self.size}>"


def _allreduce(group: TensorGroup, x: tf.Tensor, name: str) -> tf.Tensor:
    return _graph_collectives.allreduce(x, group.comm, _CHAIN, name)


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

    @tf.custom_gradient
    def gathered(t):
        stacked = _graph_collectives.allgather_stacked(t, group.comm, _CHAIN, "tnt_tp_allgather")
        out = tf.concat(tf.unstack(stacked, num=group.size), axis=-1)

        def grad(dy):
            start = group.rank * width
            return dy[..., start:start + width]

        return out, grad

    return gathered(x)
