"""``tnt.hybrid``: the layouts that combine strategies — ``ParallelStrategy.ALL``.

    model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.ALL,
                      num_pipeline_stages=p, tensor_parallel_size=t)   # N / (p * t) replicas

ALL is data replicas of pipelines (t = 1), of tensor groups (p = 1), or of pipelines whose
stages are tensor groups (``TensorPipelinedModel``). This subpackage holds what belongs
to the combination only: the combined model and ALL's entry in the strategy registry. It
composes pipelining and layer parallelism through their public names
(``tarantella.pipelining``, ``tarantella.tensor_parallel.parts``). See
docs/architecture.md and docs/tensor_parallel.md.
"""

from __future__ import annotations

from ._model import TensorPipelinedModel, check_pairs_in_one_stage
from ._strategy import build_all, load_all  # importing it registers ALL (tarantella._core.strategy)

__all__ = ["TensorPipelinedModel", "build_all", "check_pairs_in_one_stage", "load_all"]
