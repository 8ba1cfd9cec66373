"""``tnt.pipelining``: cut a Keras model into pipeline stages on different ranks.

    plan = tnt.pipelining.plan(keras_model, num_pipeline_stages=2)
    plan.summary()
    model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                      num_pipeline_stages=2, num_micro_batches=8, pipeline_schedule="1f1b")

See docs/pipelining.md.
"""

from __future__ import annotations

from .._core.deferred import deferred_variables, is_deferred
from .._core.errors import PipelineError
from ._interleaved import check_interleaved_strategy
from ._local import LocalPipeline
from ._model import PipelinedModel
from ._plan import Boundary, Plan, Stage, plan
from ._schedule import (
    INTERLEAVED,
    SCHEDULES,
    SPLIT_BACKWARD,
    Action,
    ActionKind,
    ScheduleGrid,
    actions,
    activation_bound,
    check_virtual_stages,
    compute_order,
    micro_batch_sizes,
    peak_in_flight,
    schedule_grid,
    verify,
)
from ._stages import StageModel, build_stage
from ._stats import pipeline_idle_fractions
from ._strategy import load_model  # also registers PIPELINING (tarantella._core.strategy)

__all__ = [
    "INTERLEAVED",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "Action",
    "ActionKind",
    "Boundary",
    "LocalPipeline",
    "PipelineError",
    "PipelinedModel",
    "Plan",
    "ScheduleGrid",
    "Stage",
    "StageModel",
    "actions",
    "activation_bound",
    "build_stage",
    "check_interleaved_strategy",
    "check_virtual_stages",
    "compute_order",
    "deferred_variables",
    "is_deferred",
    "load_model",
    "micro_batch_sizes",
    "peak_in_flight",
    "pipeline_idle_fractions",
    "plan",
    "schedule_grid",
    "verify",
]
