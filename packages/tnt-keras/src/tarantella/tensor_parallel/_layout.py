"""Where each rank sits when layers are split: N = data replicas x pipeline stages x t.

``rank = (replica * p + stage) * t + shard`` (DESIGN.md, "Layer parallelism"): a tensor
group is t adjacent ranks (its per-layer collectives are latency-bound: keep it on one
node); the replica group of a rank is the ranks holding the same shard of the same stage
in the other replicas, over which gradients and metric states are summed.

TENSOR is one group (N == t); ALL runs data replicas of tensor groups (p == 1, this
package's model) or of pipelines whose stages are tensor groups (p > 1, ``_stages``).
"""

from __future__ import annotations

from dataclasses import dataclass

import tnt_comm

from ._errors import TensorParallelError


@dataclass(frozen=True)
class Layout:
    """The job's ranks as ``replicas`` copies of ``num_pipeline_stages`` tensor groups of
    ``tensor_parallel_size`` ranks each."""

    size: int
    tensor_parallel_size: int
    num_pipeline_stages: int = 1

    @property
    def replicas(self) -> int:
        """Data-parallel copies of the (pipeline of) tensor group(s): N / (p t)."""
        return self.size // (self.tensor_parallel_size * self.num_pipeline_stages)

    def replica(self, rank: int) -> int:
        """The copy ``rank`` belongs to (which slice of each global batch it reads)."""
        return rank // (self.tensor_parallel_size * self.num_pipeline_stages)

    def stage(self, rank: int) -> int:
        """The pipeline stage ``rank`` holds (0 without stages)."""
        return rank // self.tensor_parallel_size % self.num_pipeline_stages

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
    group = t * num_pipeline_stages
    if size % group:
        stages = f" x num_pipeline_stages={num_pipeline_stages}" if num_pipeline_stages > 1 else ""
        raise TensorParallelError(
            f"ParallelStrategy.ALL runs N = data replicas x pipeline stages x tensor_parallel_size ranks, "
            f"but {size} rank(s) is not a multiple of tensor_parallel_size={t}{stages} = {group}. Launch a "
            f"multiple of {group} ranks (e.g. `tarantella -n {2 * group}` for 2 replicas) or change "
            f"tensor_parallel_size{' or the number of stages' if stages else ''} so that it divides {size}.")
    return Layout(size, t, num_pipeline_stages)


def replica_group(layout: Layout) -> tnt_comm.Communicator | None:
    """The ranks holding the same shard in every replica (None with one replica).

    Collective over the job: every rank calls it once, in the same order as other splits.
    """
    if layout.replicas == 1:
        return None
    world = tnt_comm.world()
    return world.split(layout.shard(world.rank), world.rank)
