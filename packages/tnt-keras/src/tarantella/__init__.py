"""Tarantella: distributed training of Keras 3 models, exactly as serial Keras.

Three strategies, with the results serial Keras gives for the same global batch. Data
parallelism (the default): every rank trains the whole model on its share of a batch.

    import tarantella as tnt
    model = tnt.Model(keras_model)
    model.compile(...); model.fit(dataset_batched_with_the_global_batch_size)

Pipeline parallelism: the model cut into stages on different ranks, fed micro-batches.

    model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                      num_pipeline_stages=2, num_micro_batches=8)   # tarantella -n 2
    model.compile(...); model.fit(...)

Layer (tensor) parallelism: large layers' weights split over a group of ranks.

    model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.TENSOR,
                      tensor_parallel_size=2)                       # tarantella -n 2
    model.compile(...); model.fit(...)

``ParallelStrategy.ALL`` combines them: N / (p * t) data replicas of p stages of t-rank
tensor groups. Launch with ``tarantella -n N -- train.py``; ``python train.py`` is a
1-rank run. How it is built: docs/architecture.md.
"""

from __future__ import annotations

from . import (
    auto,
    data_parallel,
    hybrid,
    keras,
    models,
    native,
    pipelining,
    tensor_parallel,
    timeline,
)
from ._core.deferred import deferred_variables
from ._core.inputs import InputError
from ._core.internals import UnsupportedVersionError
from ._core.memory import MemoryBudgetError
from ._core.runtime import get_master_rank, get_rank, get_size, is_master_rank, setup
from ._core.settings import SettingError
from ._core.strategy import ParallelStrategy
from ._core.sync import ReplicaMismatchError
from .auto import plan_parallel
from .data_parallel import Model, UnsyncedReplicasError, local_batch_size

__version__ = "0.1.0"

setup()
timeline._start_from_env()

__all__ = [
    "InputError",
    "MemoryBudgetError",
    "Model",
    "ParallelStrategy",
    "ReplicaMismatchError",
    "SettingError",
    "UnsupportedVersionError",
    "UnsyncedReplicasError",
    "__version__",
    "auto",
    "data_parallel",
    "deferred_variables",
    "get_master_rank",
    "get_rank",
    "get_size",
    "hybrid",
    "is_master_rank",
    "keras",
    "local_batch_size",
    "models",
    "native",
    "pipelining",
    "plan_parallel",
    "tensor_parallel",
    "timeline",
]

# Errors show under their public names (tnt.InputError), not the private modules'.
for _error in (InputError, ReplicaMismatchError, SettingError, UnsupportedVersionError,
               UnsyncedReplicasError):
    _error.__module__ = __name__
del _error
