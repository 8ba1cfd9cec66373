"""Sharded replicas of one pipeline stage: ``sharding=1|2`` on ALL's replica axis.

Within the replica group of a stage (the same stage, and tensor shard, of every pipeline
replica) each replica owns whole variables of the stage — DATA's byte-balanced assignment
(``tnt.data_parallel.assign_owners``), a pure function of the stage's variable sizes and
the group size, so every replica computes the same one. The stage's optimizer is built on
the owned variables only (its slots are the memory saved) and applies their global
gradients; then every owner's updated values are allgathered in the group, so the replicas
hold bitwise identical weights. Level 1 sums gradients with the group's allreduce as at
level 0; level 2 reduce-scatters the dense ones, so a replica receives only its own sums.

This is the Python-driven step end of a pipeline stage (``_stage_runtime``): eager numpy
collectives on the replica group's communicator, one call per bucket of at most
``bucket_bytes`` (``_core.shard_buckets``; docs/sharding.md).

Level 3 (parameters too) gathers per stage per step, not per layer per micro-batch: a
replica stores only its owned variables between steps; the stage's others are allgathered
once before the schedule's first forward and freed again after its last backward, before
the reduce-scatter and the optimizer's update (``StageRuntime.train_step``). Why not per
layer: a pipeline runs each layer once per micro-batch (m >= 4p by default), so ZeRO-3
proper would gather every weight 2m times a step (forward and backward of each micro-batch,
DeepSpeed refuses ZeRO-3 with pipelines for this reason), where per step it is gathered
once: the allgather level 2 runs after the update, moved to before the schedule, the same
bytes. What it saves: the non-owned weights between steps and during the update (4 bytes
per parameter not owned), not the in-step peak (the whole stage and its gradients exist
during backprop, as at level 2). A freed variable keeps its backing ``tf.Variable``
(a buffer of 0 elements: ``_core.internals.park_value``), so the schedule's traced passes,
which captured it, need no retrace; an eager read outside tnt's steps raises
``ShardingError`` naming the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

import tnt_comm

from .._core.shard_buckets import BUCKET_BYTES
from ..data_parallel import PerStepShards, ShardingError, assign_owners


def _nbytes(v) -> int:
    return int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size


class StageShards(PerStepShards):
    """Who owns which trainable variable of a stage in its replica group, and the group's
    reduce-scatter of gradients and allgather of updated values; level 3's per-step storage
    is ``PerStepShards``' (shared with DATA's own ``train_step``)."""

    def __init__(self, level: int, comm: tnt_comm.Communicator, bucket_bytes: int = BUCKET_BYTES) -> None:
        super().__init__(comm, bucket_bytes, "parallel_strategy=ALL, sharding=3", " of its pipeline stage")
        self.level = level

    def assign(self, variables: Sequence) -> None:
        """Fix the owners of ``variables`` (the stage's trainable ones, at compile)."""
        self.owners = assign_owners([_nbytes(v) for v in variables], self.size) if len(variables) >= self.size \
            else [i % self.size for i in range(len(variables))]

    def owns(self, i: int) -> bool:
        return self.owners[i] == self.rank

    def owned(self, items: Sequence) -> list:
        """The entries of ``items`` (one per trainable variable) this replica owns."""
        return [x for i, x in enumerate(items) if self.owners[i] == self.rank]

    def bytes_per_replica(self, variables: Sequence) -> list[int]:
        loads = [0] * self.size
        for v, o in zip(variables, self.owners):
            loads[o] += _nbytes(v)
        return loads

    def bucket_count(self, variables: Sequence) -> int:
        """How many allgathers of updated values one step runs for ``variables``."""
        return len(self.layout(range(len(variables)), lambda i: np.dtype(variables[i].dtype),
                               lambda i: _nbytes(variables[i])))

    def reduce_scatter(self, grads: list, positions: Sequence[int]) -> dict[int, tf.Tensor]:
        """Level 2: the SUM over the group of the owned ones of ``grads[positions]`` (dense),
        one bucket at a time."""
        arrays = {i: np.asarray(grads[i]) for i in positions}
        out: dict[int, tf.Tensor] = {}
        for _, idx in self.layout(positions, lambda i: arrays[i].dtype, lambda i: arrays[i].nbytes):
            counts = [sum(arrays[i].size for i in idx if self.owners[i] == r) for r in range(self.size)]
            flat = np.concatenate([arrays[i].reshape(-1) for i in idx])
            mine = self.comm.reduce_scatter(flat, counts)
            del flat
            offset = 0
            for i in idx:
                if self.owners[i] == self.rank:
                    a = arrays[i]
                    out[i] = tf.convert_to_tensor(np.asarray(mine[offset: offset + a.size]).reshape(a.shape))
                    offset += a.size
        return out

    def gather_values(self, variables: Sequence) -> None:
        """Every owner's (updated) values to every replica of the group, one allgather per
        bucket (a bucket's copy at a time, never the whole stage's)."""
        for i, value in self.owners_values(variables):
            variables[i].assign(value)

    def release(self, variables: Sequence) -> None:
        """Level 3: free the values of the stage's trainable variables other replicas own
        (``PerStepShards.release``); nothing below level 3."""
        if self.level >= 3:
            super().release(variables)

    def whole_state(self, state: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The stage's whole optimizer state (keys as ``optimizer_state``) on replica 0 of the
        group, None on the others; ``state`` is this replica's own. Streamed one variable at a
        time from its holder (collective over the group); replica 0's scalars win."""
        holders = self.comm.allgather_object({k: (v.shape, v.dtype.str) for k, v in state.items()})
        whole: dict[str, np.ndarray] = dict(state) if self.rank == 0 else {}
        for r in range(1, self.size):
            for key, (shape, dtype) in holders[r].items():
                if key in holders[0]:
                    continue  # iterations, learning rate: every replica holds them alike
                buf = state[key] if self.rank == r else np.empty(shape, np.dtype(dtype))
                value = self.comm.broadcast(np.ascontiguousarray(buf).reshape(-1), r)
                if self.rank == 0:
                    whole[key] = np.asarray(value).reshape(shape)
        return whole if self.rank == 0 else None



def check_enough_variables(count: int, size: int, stage: int, level: int, transport) -> None:
    """Every rank raises alike when some stage has fewer trainable variables than replicas
    (collective over the pipeline: the stages' counts differ)."""
    short = np.zeros(transport.num_stages, np.float64)
    if count < size:
        short[stage] = 1.0
    short = transport.pipeline_allreduce(short)
    stages = [s for s in range(len(short)) if short[s]]
    if stages:
        raise ShardingError(
            f"tnt.Model(sharding={level}) gives each of the {size} replicas of a pipeline stage whole "
            f"variables to own, but stage(s) {stages} have fewer trainable variables than that; use "
            "sharding=0, fewer replicas, or other stage cuts (pipeline_plan=, num_pipeline_stages=).")
