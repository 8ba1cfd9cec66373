"""Where each rank sits when layers are split: N = data replicas x pipeline stages x t.

``rank = (replica * p + stage) * t + shard`` (DESIGN.md, "Layer parallelism"): a tensor
group is t adjacent ranks (its per-layer collectives are latency-bound: keep it on one
node); the replica group of a rank is the ranks holding the same shard of the same stage
in the other replicas, over which gradients and metric states are summed.

Built so far: TENSOR (one group, N == t) and ALL with data replicas of tensor groups
(p == 1). Pipeline stages of tensor groups are refused with an error naming what runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import tnt_comm

from ._errors import TensorParallelError


@dataclass(frozen=True)
class Layout:
    """The job's ranks as ``replicas`` copies of one tensor group of ``tensor_parallel_size``."""

    size: int
    tensor_parallel_size: int

    @property
    def replicas(self) -> int:
        """Data-parallel copies of the tensor group (N / t)."""
        return self.size // self.tensor_parallel_size

    def replica(self, rank: int) -> int:
        """The copy ``rank`` belongs to (which slice of each global batch it reads)."""
        return rank // self.tensor_parallel_size

    def shard(self, rank: int) -> int:
        """``rank``'s shard index inside its tensor group."""
        return rank % self.tensor_parallel_size


def check_layout(strategy: str, size: int, t: int, num_pipeline_stages: int = 1) -> Layout:
    """The layout of ``size`` ranks for ``strategy`` ("tensor" or "all"), or a
    TensorParallelError naming the fix."""
    if strategy == "tensor" and size != t:
        raise TensorParallelError(
            f"ParallelStrategy.TENSOR splits layers over tensor_parallel_size={t} ranks, but the job "
            f"has {size} rank(s). Launch with `tarantella -n {t}` (or pass tensor_parallel_size={size}), "
            f"or use ParallelStrategy.ALL for data replicas of {t}-rank tensor groups (N a multiple of {t}).")
    if num_pipeline_stages > 1:
        raise TensorParallelError(
            f"ParallelStrategy.ALL with tensor_parallel_size={t} and {num_pipeline_stages} pipeline stages "
            "is not available yet. Supported with tensor_parallel_size > 1: data replicas x tensor groups "
            f"(N = replicas x {t}, one stage: no SplitLayer markers, no num_pipeline_stages). Pipelines "
            "of unsplit layers run with tensor_parallel_size=1.")
    if size % t:
        raise TensorParallelError(
            f"ParallelStrategy.ALL runs N = data replicas x pipeline stages x tensor_parallel_size ranks, "
            f"but {size} rank(s) is not a multiple of tensor_parallel_size={t}. Launch a multiple of {t} "
            f"ranks (e.g. `tarantella -n {2 * t}` for 2 replicas) or pass a tensor_parallel_size that "
            f"divides {size}.")
    return Layout(size, t)


def replica_group(layout: Layout) -> tnt_comm.Communicator | None:
    """The ranks holding the same shard in every replica (None with one replica).

    Collective over the job: every rank calls it once, in the same order as other splits.
    """
    if layout.replicas == 1:
        return None
    world = tnt_comm.world()
    return world.split(layout.shard(world.rank), world.rank)
