"""Blocking collectives as graph ops, kept in creation order per chain.

Every rank must issue the same collectives in the same order. All ranks trace the same
graph, and each collective of a *chain* takes the previous one of its graph as an extra
input, so the executor runs them in creation order whatever else could run in parallel.
They are stateful: never pruned, constant-folded or merged by Grappler. The native ops
(``tarantella.native``) run them without Python; the ``tf.numpy_function`` fallback
calls the same tnt_comm collectives. Neither can live inside XLA.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tnt_comm

from .. import native as _native

_last: dict[tuple[int, str], tf.Tensor] = {}


def _after(chain: str) -> tuple[list[tf.Tensor], object]:
    """The previous collective of ``chain`` in the graph being built (if any), and the graph."""
    if tf.executing_eagerly():
        return [], None
    graph = tf.compat.v1.get_default_graph()
    prev = _last.get((id(graph), chain))
    return ([prev] if prev is not None and prev.graph is graph else []), graph


def _record(chain: str, graph: object, out: tf.Tensor) -> None:
    if graph is not None:
        _last[(id(graph), chain)] = out


def allreduce(x: tf.Tensor, comm: tnt_comm.Communicator, chain: str, name: str,
              op: tnt_comm.Op = tnt_comm.Op.SUM) -> tf.Tensor:
    """``op`` over ``comm``'s ranks of ``x``, after the previous collective of ``chain``."""
    after, graph = _after(chain)
    native = _native.ops()
    if native is not None:
        out = native.tnt_allreduce(x, after, comm=comm.native_handle(), reduce_op=int(op), name=name)
    else:
        out = tf.numpy_function(lambda a, *_: comm.allreduce(np.ascontiguousarray(a), op),
                                [x, *after], x.dtype, stateful=True, name=name)
        out.set_shape(x.shape)
    _record(chain, graph, out)
    return out


def allgather_stacked(x: tf.Tensor, comm: tnt_comm.Communicator, chain: str, name: str) -> tf.Tensor:
    """Every rank's ``x`` (same shape everywhere) stacked on a new axis 0 in rank order."""
    after, graph = _after(chain)
    native = _native.ops()
    if native is not None:
        out = native.tnt_allgather(x, after, comm=comm.native_handle(), group_size=comm.size, name=name)
    else:
        out = tf.numpy_function(lambda a, *_: comm.allgather(np.ascontiguousarray(a)[None]),
                                [x, *after], x.dtype, stateful=True, name=name)
        out.set_shape(tf.TensorShape([comm.size]).concatenate(x.shape))
    _record(chain, graph, out)
    return out
