"""Level 3 gathered per step: a replica stores only the trainable variables it owns between
steps; the others are allgathered just before a step and freed again after it.

Why per step (not per layer, as ``_layer_shards``): the step runs code tnt does not trace
layer by layer — a pipeline stage's schedule (ALL), or a model's own ``train_step`` (DATA)
that differentiates with its own tape over ``model.trainable_variables`` and hands the
gradients to its optimizers' ``apply``. Around such a step the whole weights must exist; in
it, level 2 runs unchanged (reduce-scatter to the owners, the owners update). What level 3
saves is the non-owned weights between steps (4 bytes per parameter not owned); the in-step
peak is level 2's.

A freed variable keeps its backing ``tf.Variable`` with a buffer of 0 elements
(``_core.internals.park_value``), so the traced functions that captured it (Keras' train
function, a stage's schedule) run on without retracing once :meth:`PerStepShards.gather`
gave it its value again; an eager read while freed raises ``ShardingError`` naming the fix
(``ReleasedWeight``). The gather is one allgather per bucket of at most ``bucket_bytes`` on
the replica group's communicator, laid out by (owner, position) as level 2's buckets
(``_core.shard_buckets``), eager numpy: it runs between steps, outside any traced function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import tensorflow as tf

import tnt_comm

from .._core import internals as _internals
from .._core.shard_buckets import BUCKET_BYTES, cut_into_buckets
from ._layer_shards import ReleasedWeight
from ._sharding import _nbytes


class PerStepShards:
    """The owners of a group's trainable variables, their bucketed eager allgather, and level
    3's per-step storage (release between steps, gather before one). ``layout`` and ``group``
    name the setting in the error a freed variable's read raises."""

    def __init__(self, comm: tnt_comm.Communicator, bucket_bytes: int = BUCKET_BYTES,
                 layout: str = "sharding=3", group: str = "") -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.bucket_bytes = bucket_bytes  # the most bytes one collective moves
        self.owners: list[int] = []
        self._where = (layout, group)
        self._parked: dict[int, tuple] = {}  # id(variable) -> (variable, its backing tf.Variable)
        self._released = False  # the non-owned values are freed (alike on every replica)
        self._freed_from: tuple[list, list[int]] = ([], [])  # (variables, owners) at the release
        self._holds = 0  # nesting depth of ``gathered()``
        self._refree = False  # whether the outermost ``gathered()`` found them released

    # -- the wire layout -------------------------------------------------------------------
    def layout(self, positions: Sequence[int], dtype_of, nbytes_of) -> list[tuple[np.dtype, list[int]]]:
        """``positions`` by dtype, cut into buckets of at most ``bucket_bytes`` (``shard_buckets``),
        each ordered by (owner, position): the wire layout, one collective per bucket."""
        by_dtype: list[tuple[np.dtype, list[int]]] = []
        for i in positions:
            dt = dtype_of(i)
            for known, members in by_dtype:
                if known == dt:
                    members.append(i)
                    break
            else:
                by_dtype.append((dt, [i]))
        return [(dt, sorted(bucket, key=lambda i: (self.owners[i], i)))
                for dt, members in by_dtype
                for bucket in cut_into_buckets(members, [nbytes_of(i) for i in members], self.bucket_bytes)]

    def owners_values(self, variables: Sequence) -> Iterator[tuple[int, np.ndarray]]:
        """(index, the owner's value) of each variable of ``variables`` this replica does not
        own, one allgather per bucket of the layout (collective over the group)."""
        for dt, idx in self.layout(range(len(variables)), lambda i: np.dtype(variables[i].dtype),
                                   lambda i: _nbytes(variables[i])):
            mine = [np.asarray(variables[i].numpy()).reshape(-1) for i in idx if self.owners[i] == self.rank]
            flat = np.concatenate(mine) if mine else np.zeros(0, dt)
            del mine
            whole = self.comm.allgather(np.ascontiguousarray(flat))
            del flat
            offset = 0
            for i in idx:
                n = int(np.prod(variables[i].shape))
                if self.owners[i] != self.rank:
                    yield i, np.asarray(whole[offset: offset + n]).reshape(variables[i].shape)
                offset += n
            del whole

    # -- storage -------------------------------------------------------------------------------
    @property
    def released(self) -> bool:
        """Whether the replicas store only what they own now (the same answer on every replica)."""
        return self._released

    def is_released(self, variable) -> bool:
        """Whether this replica's copy of ``variable`` is freed now."""
        return id(variable) in self._parked

    def stored_bytes(self, variables: Sequence) -> int:
        """Bytes the buffers of ``variables`` hold now, read from the buffers themselves (a
        freed variable's holds 0 elements), not from their shapes."""
        total = 0
        for v in variables:
            backing = self._parked[id(v)][1] if id(v) in self._parked else v.value
            buffer = tf.raw_ops.ReadVariableOp(resource=backing.handle, dtype=backing.dtype)
            total += int(tf.size(buffer)) * backing.dtype.size
        return total

    def release(self, variables: Sequence) -> None:
        """Free the values of the variables of ``variables`` other replicas own (``owners``,
        one per variable); no collective. Nothing before owners are assigned, nor while
        ``gathered()`` holds them."""
        if len(self.owners) != len(variables) or self._holds:
            return
        layout, group = self._where
        for i, v in enumerate(variables):
            if self.owners[i] != self.rank and id(v) not in self._parked:
                freed = ReleasedWeight(v.path, self.owners[i], layout, group)
                self._parked[id(v)] = (v, _internals.park_value(v, freed))
        self._released = True
        self._freed_from = (list(variables), list(self.owners))

    def gather(self, values: bool = True) -> None:
        """Every freed variable gets its owner's value again, one allgather per bucket (the
        layout over the variables and owners of the release, which a recompile may have
        changed since; collective over the group). Not ``values``: zeros instead, no
        collective (about to be overwritten, e.g. by a file)."""
        if not self._released:
            return
        variables, owners = self._freed_from
        assigned, self.owners = self.owners, owners  # the layout of the release
        try:
            if not values:
                for v, backing in self._parked.values():
                    _internals.unpark_value(v, backing, np.zeros(v.shape, np.dtype(backing.dtype.as_numpy_dtype)))
            else:
                for i, value in self.owners_values(variables):
                    v = variables[i]
                    if id(v) in self._parked:
                        _internals.unpark_value(v, self._parked[id(v)][1], value)
        finally:
            self.owners = assigned
        self._parked.clear()
        self._released = False
        self._freed_from = ([], [])

    @contextlib.contextmanager
    def gathered(self, variables: Sequence, values: bool = True) -> Iterator[None]:
        """While inside, every replica holds the whole weights (once released: gathered on
        entry, a collective, and the non-owned ones freed again on exit); nests; nothing
        before the first release (the first synchronisation comes first)."""
        if self._holds == 0:
            self._refree = self._released
            self.gather(values)
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            if self._holds == 0 and self._refree:
                self.release(variables)


class GatheredStepFunctions:
    """Mixin of a ``keras.Model`` whose level 3 gathers per step: each call of Keras' train,
    test and predict functions (one step, or ``steps_per_execution`` steps) runs inside
    ``self._per_call()`` — the whole weights gathered just before it and the non-owned ones
    freed after it, outside the traced step, whose functions keep the variables' handles.
    ``_per_step`` and ``_per_call`` are the model's; below level 3 (``_per_step()`` None)
    Keras' functions stay unwrapped."""

    def _per_step(self) -> PerStepShards | None:
        raise NotImplementedError

    def _per_call(self, gather: bool = True) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def make_train_function(self, force=False):
        """Keras' train function, gathering the weights before each call and releasing the
        non-owned ones after it at level 3 (unchanged otherwise)."""
        super().make_train_function(force)
        return self._gathered_per_call("train_function", self.train_function)

    def make_test_function(self, force=False):
        """Keras' test function, gathering the weights before each call and releasing the
        non-owned ones after it at level 3 (unchanged otherwise)."""
        super().make_test_function(force)
        return self._gathered_per_call("test_function", self.test_function)

    def make_predict_function(self, force=False):
        """Keras' predict function, gathering the weights before each call and releasing the
        non-owned ones after it at level 3 (unchanged otherwise)."""
        super().make_predict_function(force)
        return self._gathered_per_call("predict_function", self.predict_function)

    def _gathered_per_call(self, name: str, function):
        if function is None or getattr(function, "_tnt_per_step", False) or self._per_step() is None:
            return function

        def gathered(*args, **kwargs):
            with self._per_call():
                return function(*args, **kwargs)

        gathered._tnt_per_step = True
        setattr(self, name, gathered)
        return gathered
