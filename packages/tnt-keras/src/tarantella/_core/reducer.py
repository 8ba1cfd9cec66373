"""Graph glue between a TensorFlow step function and tnt_comm's fused allreduce engine.

:meth:`GraphReducer.reduce` puts one submit op per fusion bucket into the step graph,
taking that bucket's tensors as inputs. TensorFlow's executor runs an op as soon as its
inputs exist, so a bucket goes to the engine (and on the wire, large buckets first: Note
[Large buckets first] in tnt_comm's fused.cc) the moment its last gradient is computed,
while backprop of earlier layers continues. One wait op per bucket then returns that
bucket's SUM as one flat tensor as soon as it is reduced, which the graph splits into the
slots: the optimizer updates a bucket's variables, and the bucket is freed, while later
buckets are still in flight (Note [One wait per bucket] in native/tnt_tf_ops.cc).
One Python call per bucket (not per tensor) keeps the step's host overhead independent
of the number of weights. No extra pass over the gradients: a rank without data masks
its gradients inside the submit (zeros instead of the values: rare, so free in the common
case), and every slot starts 64-byte aligned in its bucket, so ``tf.split`` hands out
views instead of copies. The engine buckets the tensors by a plan that is a pure
function of the specs and the fusion threshold, so every rank issues the same
collectives in the same order.

Every submit op also takes a *start token*: a tensor that only exists at run time (a read
of a variable nobody writes, made before backprop, or the previous reduction's result). Without it, a
rank whose micro-batch is statically empty (``batch(B, drop_remainder=True)`` with B < N)
has only constant inputs to its submit ops, and Grappler constant-folds them — runs them
once while optimising the graph and never again — so the other ranks wait forever.

``tf.numpy_function`` is not XLA-compilable, so ``reduce`` must be called outside any
XLA-compiled function; the training step compiles the parts before and after it instead
(``_steps.DistributedSteps``, docs/keras.md).

Note [One step end]: every strategy ends a training step here, on the same engine with
the same bucket plan, through one of two glues chosen by one rule — *who drives the
step*. When the step is one traced ``tf.function`` (data parallelism; tensor groups with
data replicas), :class:`GraphReducer` puts the exchange into the graph, where buckets
leave while backprop continues. When Python drives the step (a pipeline stage runs its
schedule eagerly, calling compiled forward and backward passes), the stage's gradients
are complete when its schedule ends: :class:`EagerReducer` submits them at once, with no
graph to trace and nothing left to overlap. Sparse gradients are gathered in rank order
after the dense SUM in both (Note [Sparse gradients as serial]).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

import tnt_comm

from .. import native as _native
from . import trace as _trace

_TOKEN = np.zeros((), dtype=np.int32)
# TensorFlow's Split shares the input's memory for an output that starts 64-byte aligned
# (EIGEN_MAX_ALIGN_BYTES) and copies the others.
_SLOT_ALIGNMENT = 64


_start_variable: tf.Variable | None = None


def start_token() -> tf.Tensor:
    """A tensor Grappler cannot constant-fold: the read of a variable nobody writes.

    (``tf.timestamp`` would do, but op determinism forbids it.) Reading it orders nothing:
    only ops touching the same variable are ordered against a read.
    """
    global _start_variable
    if _start_variable is None:
        with tf.init_scope():  # created eagerly, also when first asked for inside a trace
            _start_variable = tf.Variable(0, trainable=False, dtype=tf.int32, name="tnt_start")
    return _start_variable.read_value()


@dataclass(frozen=True)
class Slot:
    """One tensor the reducer expects per step: a name for error messages, shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: tf.DType

    @property
    def count(self) -> int:
        return math.prod(self.shape)


class GraphReducer:
    """A fused SUM-allreduce of a fixed, ordered list of tensors, usable inside tf.function."""

    def __init__(self, slots: Sequence[Slot], threshold_bytes: int,
                 comm: tnt_comm.Communicator | None = None) -> None:
        """``comm``: the ranks to SUM over (a replica group); default the whole job."""
        self.slots = list(slots)
        specs = [tnt_comm.TensorSpec(s.name, s.count, s.dtype.as_numpy_dtype) for s in self.slots]
        self._engine = tnt_comm.FusedAllreduce(
            specs, threshold_bytes, tnt_comm.Op.SUM, comm=comm, slot_alignment=_SLOT_ALIGNMENT
        )
        self._plan = self._engine.plan
        self._offsets = self._engine.slot_offsets
        # The order the engine puts buckets on the wire (Note [Large buckets first]); a
        # stand-in engine without one launches in plan order.
        self._launch_order = list(getattr(self._engine, "launch_order", range(len(self._plan))))
        self._submitted: list[tuple[int, float]] = []  # (bucket, time) while a timeline records

    @property
    def plan(self) -> list[list[int]]:
        return [list(b) for b in self._plan]

    def _submit_np(
        self, members: list[int], keep_from: int, _start: np.ndarray, keep: np.ndarray, *values: np.ndarray
    ) -> np.ndarray:
        arrays = [np.ascontiguousarray(v).reshape(-1) for v in values]
        if not keep:  # a rank without data: zeros for the masked slots (rare)
            arrays = [np.zeros_like(a) if i >= keep_from else a for i, a in zip(members, arrays)]
        self._engine.submit_many(members, arrays)
        if _trace.recorder() is not None:
            self._submitted.append((self._plan.index(members) if members in self._plan else -1,
                                    time.perf_counter()))
        return _TOKEN

    def _wait_np(self, *_tokens: np.ndarray) -> list[np.ndarray]:
        rec = _trace.recorder()
        if rec is None:
            return list(self._engine.wait_buckets())
        t0 = time.perf_counter()
        out = list(self._engine.wait_buckets())
        t1 = time.perf_counter()
        rec.add("wait", "wait", "comm", t0, t1, buckets=len(out))
        for k, ts in self._submitted:  # done: when the wait returned (the engine returns all at once)
            rec.add(f"bucket {k}", "bucket", "sync", ts, t1, bucket=k)
        self._submitted = []
        return out

    def reduce(
        self,
        values: Sequence[tf.Tensor],
        start: tf.Tensor | None = None,
        keep: tf.Tensor | None = None,
        keep_from: int = 0,
        wait_after: tf.Tensor | None = None,
    ) -> list[tf.Tensor]:
        """The SUM over ranks of each value (one per slot, in slot order), shaped like it.

        ``start``: a run-time-only tensor every submit op waits for (see the module
        docstring); :func:`start_token` made here when not given. Passing the result of
        an earlier reduction orders this one after it on every rank. ``keep``: a scalar
        bool; where false, the slots from ``keep_from`` on contribute zeros (this rank's
        values there are garbage, e.g. gradients of an empty micro-batch's stand-in rows).
        ``wait_after``: a scalar int32 token; no wait for a result begins before it exists
        (the submits are not held back), so a thread blocked in this wait never holds up a
        blocking collective of the same step that another rank is already waiting in.
        """
        if len(values) != len(self.slots):
            raise ValueError(f"GraphReducer.reduce: {len(values)} values for {len(self.slots)} slots")
        if not self.slots:
            return []
        values = [
            tf.cast(v, s.dtype) if v.dtype != s.dtype else v for v, s in zip(values, self.slots)
        ]
        if start is None:
            start = start_token()
        keep = tf.constant(True) if keep is None else tf.convert_to_tensor(keep, tf.bool)
        # An engine without a native handle (a stand-in such as the benchmarks' engine that
        # exchanges nothing) is driven through numpy_function: it has no C++ core to hand over.
        # While a timeline records (at trace time), the Python path: its calls record each
        # bucket's submit and the wait (tarantella.timeline, docs/timeline.md).
        native = _native.ops() if hasattr(self._engine, "native_handle") and _trace.recorder() is None else None
        if native is not None:
            handle = self._engine.native_handle()
            tokens = [
                native.tnt_fused_submit(start, keep, [values[i] for i in members], engine=handle,
                                        members=members, keep_from=keep_from, name="tnt_submit_bucket")
                for members in self._plan
            ]
            buckets = self._wait_each(native, handle, tokens, wait_after)
        else:
            # stateful=False on purpose: a stateful op would be chained after every earlier
            # side-effecting op of the step (tf.function's automatic control dependencies), so
            # no bucket could start before backprop ends. The start token keeps Grappler from
            # constant-folding it instead.
            tokens = [
                tf.numpy_function(
                    lambda *arrays, members=members: self._submit_np(members, keep_from, *arrays),
                    [start, keep, *(values[i] for i in members)],
                    tf.int32,
                    stateful=False,
                    name="tnt_submit_bucket",
                )
                for members in self._plan
            ]
            buckets = tf.numpy_function(
                self._wait_np,
                tokens if wait_after is None else [*tokens, wait_after],
                [self.slots[members[0]].dtype for members in self._plan],
                stateful=True,
                name="tnt_wait",
            )
        out: list[tf.Tensor | None] = [None] * len(self.slots)
        for members, flat in zip(self._plan, buckets):
            sizes, slot_piece = self._pieces(members)
            flat.set_shape([sum(sizes)])
            parts = tf.split(flat, sizes) if len(sizes) > 1 else [flat]
            for i, p in zip(members, slot_piece):
                out[i] = tf.reshape(parts[p], self.slots[i].shape)
        return out

    def _wait_each(self, native, handle: int, tokens: list[tf.Tensor],
                   after: tf.Tensor | None = None) -> list[tf.Tensor]:
        """One wait op per bucket (Note [One wait per bucket] in native/tnt_tf_ops.cc), in the
        engine's launch order, each after its bucket's submit and the previous bucket's wait:
        the step consumes a bucket while later ones are still reduced, so the buckets are
        not all alive at once.

        The waits are stateful (never pruned: the engine re-arms only once every bucket was
        taken) but run outside tf.function's chain of side effects, where each would be
        ordered after every earlier stateful op without a resource input and before every
        later one: their order comes from their inputs only.
        """
        graph = tf.compat.v1.get_default_graph()
        acd = None if tf.executing_eagerly() else getattr(graph, "experimental_acd_manager", None)
        buckets: list[tf.Tensor | None] = [None] * len(self._plan)
        for b in self._launch_order:
            members = self._plan[b]
            flat, after = native.tnt_fused_wait_bucket(
                [tokens[b]] if after is None else [tokens[b], after], T=self.slots[members[0]].dtype,
                engine=handle, bucket=b, count=sum(self._pieces(members)[0]), name="tnt_wait_bucket")
            if acd is not None:
                acd.run_independently(flat.op)
            buckets[b] = flat
        return buckets

    def _pieces(self, members: list[int]) -> tuple[list[int], list[int]]:
        """A bucket's pieces (each slot, and the padding before the next slot where there
        is any) as element counts, and the piece index of each slot."""
        sizes, slot_piece = [], []
        for k, i in enumerate(members):
            slot_piece.append(len(sizes))
            sizes.append(self.slots[i].count)
            end = self._offsets[i] + self.slots[i].count
            pad = self._offsets[members[k + 1]] - end if k + 1 < len(members) else 0
            if pad:
                sizes.append(pad)
        return sizes, slot_piece

    def close(self) -> None:
        self._engine.close()


class EagerReducer:
    """The step end of a Python-driven step: SUM the dense gradients over ``comm`` with the
    fused engine, gather the sparse ones (Note [One step end])."""

    def __init__(self, comm: tnt_comm.Communicator, threshold_bytes: int) -> None:
        self._comm = comm
        self._threshold = threshold_bytes
        self._engine: tnt_comm.FusedAllreduce | None = None
        self._members: list[int] = []  # positions (of the variables) of the dense gradients

    def reduce(self, grads: list, variables: Sequence, allgather_sparse) -> list:
        """``grads`` (one per variable) summed over the group; ``allgather_sparse(g)``
        gathers a sparse one. The engine is remade when which gradients are dense changes."""
        from . import sparse as _sparse

        dense_at = [i for i, g in enumerate(grads) if not _sparse.is_sparse(g)]
        if self._engine is None or self._members != dense_at:
            self.close()
            specs = [tnt_comm.TensorSpec(variables[i].path, int(np.prod(variables[i].shape)),
                                         np.dtype(variables[i].dtype)) for i in dense_at]
            self._engine = tnt_comm.FusedAllreduce(specs, self._threshold, tnt_comm.Op.SUM, comm=self._comm)
            self._members = dense_at
        out = list(grads)
        if dense_at:
            arrays = [np.asarray(grads[i]) for i in dense_at]
            self._engine.submit_many(list(range(len(arrays))), [a.reshape(-1) for a in arrays])
            for i, a, total in zip(dense_at, arrays, self._engine.wait()):
                out[i] = tf.convert_to_tensor(np.asarray(total).reshape(a.shape))
        for i, g in enumerate(grads):
            if _sparse.is_sparse(g):
                out[i] = allgather_sparse(g)
        return out

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
