"""One mesh for every layout: the job's ranks as replicas x pipeline stages x tensor shards.

``rank = (replica * p + stage) * t + shard`` (docs/architecture.md, "The mesh"): a tensor
group is t adjacent ranks (its per-layer collectives are latency-bound: keep it on one
node); the pipeline group of a rank is the same shard of every stage of its replica; its
replica group the same stage and shard in every replica, over which gradients and metric
states are summed. DATA is the mesh p = t = 1, PIPELINING p = N, TENSOR t = N, ALL any
product. The sub-communicators are made once per (t, p) and shared by every model of
that layout (``groups``): every rank makes them at the same point of the program.
"""

from __future__ import annotations

from dataclasses import dataclass

import tnt_comm

from .errors import PipelineError, TensorParallelError


@dataclass(frozen=True)
class Mesh:
    """The job's ``size`` ranks as ``replicas`` copies of ``num_pipeline_stages`` tensor
    groups of ``tensor_parallel_size`` ranks each."""

    size: int
    tensor_parallel_size: int = 1
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

    def rank_of(self, replica: int, stage: int, shard: int) -> int:
        """The rank at these coordinates."""
        return (replica * self.num_pipeline_stages + stage) * self.tensor_parallel_size + shard


def check_layout(strategy: str, size: int, tensor_parallel_size: int = 1,
                 num_pipeline_stages: int = 1) -> Mesh:
    """The mesh of ``size`` ranks for ``strategy`` ("data", "pipelining", "tensor" or
    "all"), or the error naming the fix (PipelineError for pipelines of whole layers,
    TensorParallelError when layers are split)."""
    t, p = tensor_parallel_size, num_pipeline_stages
    if strategy == "pipelining" and size != p:
        raise PipelineError(
            f"ParallelStrategy.PIPELINING runs one pipeline of {p} stages, one per rank, "
            f"but the job has {size} ranks. Launch with `tarantella -n {p}`, or use "
            f"ParallelStrategy.ALL to run {p}-stage pipelines as data-parallel replicas "
            f"(N must then be a multiple of {p}).")
    if strategy == "tensor" and size != t:
        raise TensorParallelError(
            f"ParallelStrategy.TENSOR splits layers over tensor_parallel_size={t} ranks, but the job "
            f"has {size} rank(s). Launch with `tarantella -n {t}` (or pass tensor_parallel_size={size}), "
            f"or use ParallelStrategy.ALL for data replicas of {t}-rank tensor groups (N a multiple of {t}).")
    if strategy == "all" and t == 1 and size % p:
        raise PipelineError(
            f"ParallelStrategy.ALL runs N / p pipeline replicas, but {size} ranks is not a multiple of "
            f"num_pipeline_stages={p}. Launch a multiple of {p} ranks or change the number of stages.")
    group = t * p
    if strategy == "all" and size % group:
        stages = f" x num_pipeline_stages={p}" if p > 1 else ""
        raise TensorParallelError(
            f"ParallelStrategy.ALL runs N = data replicas x pipeline stages x tensor_parallel_size ranks, "
            f"but {size} rank(s) is not a multiple of tensor_parallel_size={t}{stages} = {group}. Launch a "
            f"multiple of {group} ranks (e.g. `tarantella -n {2 * group}` for 2 replicas) or change "
            f"tensor_parallel_size{' or the number of stages' if stages else ''} so that it divides {size}.")
    return Mesh(size, t, p)


@dataclass(frozen=True)
class Groups:
    """This rank's coordinates in ``mesh`` and its three sub-communicators (None on one rank)."""

    mesh: Mesh
    rank: int
    tensor: tnt_comm.Communicator | None    # the t ranks of this rank's stage of its replica
    pipeline: tnt_comm.Communicator | None  # the p stages of its replica (same shard)
    replica: tnt_comm.Communicator | None   # the same stage and shard in every replica

    @property
    def stage(self) -> int:
        return self.mesh.stage(self.rank)

    @property
    def shard(self) -> int:
        return self.mesh.shard(self.rank)

    @property
    def replica_index(self) -> int:
        return self.mesh.replica(self.rank)


_GROUPS: dict[Mesh, Groups] = {}


def groups(mesh: Mesh) -> Groups:
    """This rank's sub-communicators of ``mesh``, made on first use (collective over the
    job: every rank asks for the same meshes in the same order) and shared afterwards."""
    found = _GROUPS.get(mesh)
    if found is not None:
        return found
    world = tnt_comm.world()
    if world.size != mesh.size:
        raise RuntimeError(f"a mesh of {mesh.size} ranks in a job of {world.size}")  # pragma: no cover
    rank, t, p = world.rank, mesh.tensor_parallel_size, mesh.num_pipeline_stages
    if world.size == 1:
        made = Groups(mesh, 0, None, None, None)
    else:
        replica, stage, shard = mesh.replica(rank), mesh.stage(rank), mesh.shard(rank)
        made = Groups(mesh, rank,
                      tensor=world.split(replica * p + stage, shard),
                      pipeline=world.split(replica * t + shard, stage),
                      replica=world.split(stage * t + shard, replica))
    _GROUPS[mesh] = made
    return made
