"""``tnt.data_parallel``: the data-parallel wrapper (``tnt.Model``) and its step builder.

Every rank holds the whole model and computes the gradient of its micro-batch; one fused
allreduce per step sums them (docs/architecture.md, "Data flow of one training step").
``DistributedSteps`` is the step of every strategy that runs data replicas of a model
whose forward pass is one traced function (tensor groups with replicas use it, with
``Sharding`` and ``serial_optimizer`` on their replica group at ``sharding=1|2``).
"""

from __future__ import annotations

from ._grad_sync import UnsyncedReplicasError, local_batch_size
from ._layer_shards import ReleasedWeight
from ._level3_memory import Level3Holdings, Level3Layout, level3_layout
from ._model import Model
from ._per_step import GatheredStepFunctions, PerStepShards
from ._sharded_files import serial_optimizer
from ._sharding import Sharding, ShardingError, assign_owners, check_optimizer
from ._steps import DistributedSteps

__all__ = ["DistributedSteps", "GatheredStepFunctions", "Level3Holdings", "Level3Layout", "Model", "PerStepShards", "ReleasedWeight", "Sharding", "ShardingError", "UnsyncedReplicasError", "assign_owners",
           "check_optimizer", "level3_layout", "local_batch_size", "serial_optimizer"]
