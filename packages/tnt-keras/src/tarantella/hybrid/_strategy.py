"""ParallelStrategy.ALL in the strategy registry: its options, build and load.

ALL combines whatever it is given: data replicas of pipelines (t = 1, pipelining's
strategy), of tensor groups (p = 1, layer parallelism's model with replicas), or of
pipelines whose stages are tensor groups (``_model``); with nothing to split (t = 1 and
no stages: no ``num_pipeline_stages``, plan or SplitLayer markers) it is data
parallelism. It takes the options of both, as they declared them, and DATA's
``sharding=`` for its replica axis (``_sharding_level``): the replica groups of each
stage, of each tensor shard, or of both.
"""

from __future__ import annotations

import keras

from .._core import runtime as _runtime
from .._core import settings as _settings
from .._core.errors import TensorParallelError
from .._core.graph import model_graph
from .._core.mesh import check_layout
from .._core.serial_files import deferred_from_file, open_model_file
from .._core.strategy import ParallelStrategy, Strategy, register, strategy_for
from ..data_parallel import ShardingError
from ..pipelining import check_interleaved_strategy
from ..pipelining import plan as pipeline_plan_of
from ..tensor_parallel.parts import OPTIONS as TENSOR_OPTIONS
from ..tensor_parallel.parts import (
    TensorParallelModel,
    as_plan,
    check_model,
    load_model,
    size_from_options,
)
from ._model import TensorPipelinedModel

#: Pipelining's options, as it declared them (ALL takes them with the tensor group's).
STAGE_OPTIONS = strategy_for(ParallelStrategy.PIPELINING).options


def _has_stages(model: keras.Model, options: dict) -> bool:
    return (options.get("pipeline_plan") is not None or options.get("num_pipeline_stages") is not None
            or any(call.is_split for call in model_graph(model).calls))


def _pipeline_plan(model: keras.Model, options: dict):
    """The pipeline plan ALL cuts ``model`` by (None: one stage, no markers or options)."""
    if options.get("pipeline_plan") is not None:
        return options["pipeline_plan"]
    if _has_stages(model, options):
        return pipeline_plan_of(model, options.get("num_pipeline_stages"))
    return None


def _sharding_level(options: dict, tensor_parallel_size: int = 1, stages: bool = False) -> int:
    """The sharding level of ALL's replica axis (``sharding=``, else ``TNT_SHARDING``). Level 3
    runs on replicas of pipelines (per stage per step, ``pipelining._shards``), of tensor
    groups (per step, ``data_parallel.PerStepShards``) and of whole models (DATA's); with
    pipeline stages of tensor groups (t > 1 and stages) it is refused (a ShardingError naming
    the fix, alike on every rank)."""
    level = _settings.sharding_level(options.get("sharding"))
    named = f"sharding={level}" if options.get("sharding") is not None else f"TNT_SHARDING={level}"
    if level == 3 and tensor_parallel_size > 1 and stages:
        raise ShardingError(f"tnt.Model(parallel_strategy=ALL, tensor_parallel_size={tensor_parallel_size}, "
                            f"pipeline stages, {named}) (parameters sharded too) is not implemented for pipeline "
                            "stages of tensor groups yet; use sharding=2 (optimizer state and gradients) or "
                            "sharding=1 (optimizer state), or either tensor_parallel_size=1 or one stage "
                            "(sharding=3 runs on replicas of pipeline stages and of tensor groups).")
    return level


def build_all(model: keras.Model, member: ParallelStrategy, options: dict) -> keras.Model | None:
    """ALL: replicas of pipelines, of tensor groups, or of pipelines of tensor groups."""
    t = size_from_options(options, member)
    stage_options = {k: options[k] for k in STAGE_OPTIONS if k in options}
    level = _sharding_level(options, t, stages=t > 1 and _has_stages(model, options))
    if level:  # the replica groups of each stage (and shard) shard: pipelining's model takes it
        stage_options["sharding"] = level
    if t == 1:
        if not _has_stages(model, options):
            unused = sorted(set(stage_options) - {"sharding"})
            if unused:
                raise TensorParallelError(f"{', '.join(unused)} apply to pipeline stages, but the model has one "
                                          "stage: pass num_pipeline_stages=p (or put SplitLayer markers in the "
                                          "model), or drop the option(s).")
            return None  # nothing to split: data replicas (DATA's wrapper takes sharding= itself)
        return strategy_for(ParallelStrategy.PIPELINING).build(model, member, stage_options)
    check_model(model)
    check_interleaved_strategy(options.get("pipeline_schedule", "1f1b"), "all", options.get("virtual_stages"))
    pipeline = _pipeline_plan(model, options)
    if pipeline is not None and pipeline.num_stages > 1:
        kept = {k: stage_options[k] for k in ("num_micro_batches", "pipeline_schedule", "remat", "sharding")
                if k in stage_options}
        return TensorPipelinedModel(model, tensor_plan=as_plan(options.get("tensor_parallel_plan"), model, t),
                                    pipeline_plan=pipeline, **kept)
    pipelined = sorted({"num_micro_batches", "pipeline_schedule", "remat"} & set(options))
    if pipelined:
        raise TensorParallelError(
            f"{', '.join(pipelined)} apply to pipeline stages, but the model has one stage. Pass "
            "num_pipeline_stages=p (or put SplitLayer markers in the model) to run p stages of "
            f"{t}-rank tensor groups, or drop the option(s).")
    check_layout("all", _runtime.get_size(), t)
    return TensorParallelModel(model, tensor_parallel_size=t, tensor_parallel_plan=options.get("tensor_parallel_plan"),
                               parallel_strategy="all", sharding=level)


def load_all(filepath, member: ParallelStrategy, options: dict, **kwargs) -> keras.Model | None:
    """ALL: into data replicas of q-rank tensor groups, of pipelines (t = 1 with stages),
    or whole into data replicas (t = 1 without stages)."""
    t = size_from_options(options, member)
    stage_options = {k: options[k] for k in STAGE_OPTIONS if k in options}
    stages = stage_options.get("num_pipeline_stages") is not None or (t == 1 and _file_has_markers(filepath, kwargs))
    level = _sharding_level(options, t)
    if t > 1:
        if stage_options:
            raise TensorParallelError(
                f"tnt.models.load_model(parallel_strategy=ALL, tensor_parallel_size > 1) with "
                f"{', '.join(sorted(stage_options))}: loading into pipeline stages of tensor groups is not "
                "available yet. Load the file with keras.saving.load_model on every rank and wrap that model "
                "with tnt.Model(..., parallel_strategy=ALL, num_pipeline_stages=p, tensor_parallel_size=t).")
        tensor_options = {k: options[k] for k in TENSOR_OPTIONS if k in options}
        return load_model(filepath, parallel_strategy="all", sharding=level, **tensor_options, **kwargs)
    if stages:
        sharded = {"sharding": level} if level else {}
        return strategy_for(ParallelStrategy.PIPELINING).load(filepath, member, {**stage_options, **sharded}, **kwargs)
    if stage_options:
        raise TensorParallelError(f"{', '.join(sorted(stage_options))} apply to pipeline stages; pass "
                                  "num_pipeline_stages=q to load into q stages, or drop the option(s).")
    return None


def _file_has_markers(filepath, kwargs: dict) -> bool:
    """Whether the file's model has SplitLayer markers (read from its config only)."""
    with open_model_file(filepath) as (_, archive):
        if archive is None:
            return False
        full = deferred_from_file(archive, kwargs.get("custom_objects"), False, kwargs.get("safe_mode", True))
    return any(call.is_split for call in model_graph(full).calls)


register(Strategy(name="all", handles=(ParallelStrategy.ALL,), options=TENSOR_OPTIONS + STAGE_OPTIONS + ("sharding",),
                  error=TensorParallelError, build=build_all, load=load_all))
