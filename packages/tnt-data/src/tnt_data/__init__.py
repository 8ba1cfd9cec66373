"""tnt_data: reproducible sample-level sharding of tf.data input pipelines.

``distribute(dataset, rank=r, size=n)`` turns a pipeline batched with the global batch
size into the micro-batches rank r of n processes, so that n ranks together process
exactly what serial training processes, step by step. No MPI: rank and size are plain
arguments. ``index_plan`` gives the same split for any indexable sequence, without
TensorFlow.
"""

from typing import TYPE_CHECKING

from tnt_data._plan import (
    global_batch_sizes,
    index_plan,
    micro_batch_size,
    micro_batch_sizes,
    micro_batch_slice,
)
from tnt_data.errors import DistributionError

if TYPE_CHECKING:  # imported lazily below; listed here for type checkers and the API docs
    from tnt_data._distribute import DEFAULT_SHUFFLE_SEED, Strategy, distribute, split_strategy
    from tnt_data._inspect import PipelineInfo, inspect
    from tnt_data._slicing import StepSizes, split_batches

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


_NEEDS_TENSORFLOW = {
    "distribute": "_distribute",
    "split_strategy": "_distribute",
    "Strategy": "_distribute",
    "DEFAULT_SHUFFLE_SEED": "_distribute",
    "inspect": "_inspect",
    "PipelineInfo": "_inspect",
    "StepSizes": "_slicing",
    "split_batches": "_slicing",
}


def __getattr__(name: str):
    # TensorFlow is imported on first use, so the framework-free index plan works (and
    # stays cheap) without it.
    module = _NEEDS_TENSORFLOW.get(name)
    if module is None:
        raise AttributeError(f"module 'tnt_data' has no attribute {name!r}")
    try:
        import tensorflow  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "tensorflow":
            raise
        raise ImportError(
            f"tnt_data.{name} works on tf.data pipelines and needs TensorFlow, which is not "
            "installed: `pip install 'tnt-data[tf]'` (or any TensorFlow build, e.g. "
            "tensorflow-cpu). Without TensorFlow, use the index plan: tnt_data.index_plan, "
            "micro_batch_sizes, micro_batch_slice."
        ) from exc
    import importlib

    return getattr(importlib.import_module(f"tnt_data.{module}"), name)
