"""tnt_data: reproducible sample-level sharding of tf.data input pipelines.

``distribute(dataset, rank=r, size=n)`` turns a pipeline batched with the global batch
size into the micro-batches rank r of n processes, so that n ranks together process
exactly what serial training processes, step by step. No MPI: rank and size are plain
arguments. ``index_plan`` gives the same split for any indexable sequence, without
TensorFlow.
"""

from tnt_data._plan import (
    global_batch_sizes,
    index_plan,
    micro_batch_size,
    micro_batch_sizes,
    micro_batch_slice,
)
from tnt_data.errors import DistributionError

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SHUFFLE_SEED",
    "DistributionError",
    "PipelineInfo",
    "StepSizes",
    "Strategy",
    "__version__",
    "distribute",
    "global_batch_sizes",
    "index_plan",
    "inspect",
    "micro_batch_size",
    "micro_batch_sizes",
    "micro_batch_slice",
    "split_batches",
    "split_strategy",
]


def __getattr__(name: str):
    # TensorFlow is imported on first use, so the framework-free index plan stays cheap.
    if name in ("distribute", "split_strategy", "Strategy", "DEFAULT_SHUFFLE_SEED"):
        from tnt_data import _distribute

        return getattr(_distribute, name)
    if name in ("inspect", "PipelineInfo"):
        from tnt_data import _inspect

        return getattr(_inspect, name)
    if name in ("StepSizes", "split_batches"):
        from tnt_data import _slicing

        return getattr(_slicing, name)
    raise AttributeError(f"module 'tnt_data' has no attribute {name!r}")
