"""ParallelStrategy.TENSOR and ALL in the strategy registry: their options, build and load.

TENSOR splits the large layers over N == t ranks. ALL combines whatever it is given:
data replicas of pipelines (t = 1, pipelining's strategy), of tensor groups (p = 1), or
of pipelines whose stages are tensor groups (``_stages``); with nothing to split (t = 1
and no stages: no ``num_pipeline_stages``, plan or SplitLayer markers) it is data
parallelism. ``tensor_parallel_size=1`` splits nothing: the data-parallel wrapper runs.
"""

from __future__ import annotations

import keras

from .._core import internals as _internals
from .._core import runtime as _runtime
from .._core.deferred import is_deferred
from .._core.errors import TensorParallelError
from .._core.graph import model_graph
from .._core.mesh import check_layout
from .._core.serial_files import deferred_from_file, open_model_file
from .._core.strategy import ParallelStrategy, Strategy, register, strategy_for
from ..pipelining import plan as pipeline_plan_of
from ._layout_map import as_plan
from ._model import TensorParallelModel
from ._plan import check_model, check_size
from ._saving import read_tensor_state
from ._stages import TensorPipelinedModel

#: The options of a tensor group, declared once (ALL takes them with pipelining's).
OPTIONS = ("tensor_parallel_size", "tensor_parallel_plan")
#: Pipelining's options, as it declared them (ALL takes both).
_STAGE_OPTIONS = strategy_for(ParallelStrategy.PIPELINING).options


def _size(options: dict, member: ParallelStrategy) -> int:
    if member is ParallelStrategy.TENSOR and "tensor_parallel_size" not in options:
        raise TensorParallelError("ParallelStrategy.TENSOR needs tensor_parallel_size= (the ranks sharing "
                                  "each split layer), e.g. tnt.Model(m, parallel_strategy=tnt.ParallelStrategy."
                                  "TENSOR, tensor_parallel_size=2).")
    t = check_size(options.get("tensor_parallel_size", 1))
    given_plan = options.get("tensor_parallel_plan") is not None or (
        member is ParallelStrategy.ALL and "tensor_parallel_plan" in options)
    if t == 1 and given_plan:
        raise TensorParallelError("tensor_parallel_plan needs tensor_parallel_size > 1 (the ranks sharing "
                                  "each split layer); pass tensor_parallel_size=plan.tensor_parallel_size.")
    return t


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


def build_tensor(model: keras.Model, member: ParallelStrategy, options: dict) -> keras.Model | None:
    """TENSOR: this rank's shards (None with t = 1 on one rank: nothing to split)."""
    t = _size(options, member)
    if t == 1:
        check_layout("tensor", _runtime.get_size(), 1)
        return None
    return TensorParallelModel(model, tensor_parallel_size=t, tensor_parallel_plan=options.get("tensor_parallel_plan"),
                               parallel_strategy="tensor")


def build_all(model: keras.Model, member: ParallelStrategy, options: dict) -> keras.Model | None:
    """ALL: replicas of pipelines, of tensor groups, or of pipelines of tensor groups."""
    t = _size(options, member)
    stage_options = {k: options[k] for k in _STAGE_OPTIONS if k in options}
    if t == 1:
        if not _has_stages(model, options):
            unused = sorted(set(stage_options))
            if unused:
                raise TensorParallelError(f"{', '.join(unused)} apply to pipeline stages, but the model has one "
                                          "stage: pass num_pipeline_stages=p (or put SplitLayer markers in the "
                                          "model), or drop the option(s).")
            return None  # nothing to split: data replicas
        return strategy_for(ParallelStrategy.PIPELINING).build(model, member, stage_options)
    check_model(model)
    pipeline = _pipeline_plan(model, options)
    if pipeline is not None and pipeline.num_stages > 1:
        kept = {k: options[k] for k in ("num_micro_batches", "pipeline_schedule") if k in options}
        return TensorPipelinedModel(model, tensor_plan=as_plan(options.get("tensor_parallel_plan"), model, t),
                                    pipeline_plan=pipeline, **kept)
    pipelined = sorted({"num_micro_batches", "pipeline_schedule"} & set(options))
    if pipelined:
        raise TensorParallelError(
            f"{', '.join(pipelined)} apply to pipeline stages, but the model has one stage. Pass "
            "num_pipeline_stages=p (or put SplitLayer markers in the model) to run p stages of "
            f"{t}-rank tensor groups, or drop the option(s).")
    check_layout("all", _runtime.get_size(), t)
    return TensorParallelModel(model, tensor_parallel_size=t, tensor_parallel_plan=options.get("tensor_parallel_plan"),
                               parallel_strategy="all")


def load_model(filepath, *, tensor_parallel_size: int, tensor_parallel_plan=None, custom_objects=None,
               compile: bool = True, safe_mode: bool = True, parallel_strategy: str = "tensor", **kwargs):
    """Load a ``.keras`` file (saved serially or tensor-parallel at any t) split over
    ``tensor_parallel_size`` ranks; each rank reads only its slices of the split layers.

    ``tensor_parallel_plan``: a plan of the file's model (default: the automatic plan).
    ``parallel_strategy="all"``: data replicas of such groups (N a multiple of t; every
    replica reads the same slices). Pipeline stages of tensor groups cannot be loaded yet.
    """
    strategy = getattr(parallel_strategy, "value", parallel_strategy)
    stages = sorted(set(_STAGE_OPTIONS) & set(kwargs))
    if strategy == "all" and stages:
        raise TensorParallelError(
            f"tnt.models.load_model(parallel_strategy=ALL, tensor_parallel_size > 1) with {', '.join(stages)}: "
            "loading into pipeline stages of tensor groups is not available yet. Load the file with "
            "keras.saving.load_model on every rank and wrap that model with tnt.Model(..., parallel_strategy="
            "ALL, num_pipeline_stages=p, tensor_parallel_size=t).")
    if kwargs:
        raise TensorParallelError(f"tnt.models.load_model(parallel_strategy=TENSOR) got unknown keyword "
                                  f"argument(s) {sorted(kwargs)}; it takes tensor_parallel_size=, "
                                  "tensor_parallel_plan=, custom_objects=, compile= and safe_mode=.")
    with open_model_file(filepath) as (local, archive):
        if archive is None:
            raise TensorParallelError(f"{filepath} is not a .keras file: tnt.models.load_model(parallel_strategy="
                                      "TENSOR) loads .keras files (use model.load_weights for .weights.h5).")
        full = deferred_from_file(archive, custom_objects, compile, safe_mode)
        model = TensorParallelModel(full, tensor_parallel_size=tensor_parallel_size, parallel_strategy=strategy,
                                    tensor_parallel_plan=tensor_parallel_plan, _weights_from_file=True)
        split = {id(s) for s, _, _ in model._split_variables()}
        for var in full.variables:  # replicated layers (and seeds): real variables, read below
            if is_deferred(var) and id(var) not in split:
                _internals.initialize_deferred(var)
        full_optimizer = None
        if compile and full.compiled:
            args = keras.saving.deserialize_keras_object(full.get_compile_config())
            args.pop("jit_compile", None)
            model.compile(**args)
            full_optimizer = full.optimizer
        read_tensor_state(model, full, full_optimizer, _internals.weights_store(local, archive))
    return model


def load_tensor(filepath, member: ParallelStrategy, options: dict, **kwargs) -> keras.Model | None:
    """TENSOR: the file split over q ranks (None with q = 1: loaded whole)."""
    t = _size(options, member)
    if t == 1:
        check_layout("tensor", _runtime.get_size(), 1)
        return None
    return load_model(filepath, parallel_strategy="tensor", **options, **kwargs)


def load_all(filepath, member: ParallelStrategy, options: dict, **kwargs) -> keras.Model | None:
    """ALL: into data replicas of q-rank tensor groups, of pipelines (t = 1 with stages),
    or whole into data replicas (t = 1 without stages)."""
    t = _size(options, member)
    stage_options = {k: options[k] for k in _STAGE_OPTIONS if k in options}
    if t > 1:
        return load_model(filepath, parallel_strategy="all", **options, **kwargs)
    if stage_options.get("num_pipeline_stages") is not None or _file_has_markers(filepath, kwargs):
        return strategy_for(ParallelStrategy.PIPELINING).load(filepath, member, stage_options, **kwargs)
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


register(Strategy(name="tensor", handles=(ParallelStrategy.TENSOR,), options=OPTIONS,
                  error=TensorParallelError, build=build_tensor, load=load_tensor))
register(Strategy(name="all", handles=(ParallelStrategy.ALL,), options=OPTIONS + _STAGE_OPTIONS,
                  error=TensorParallelError, build=build_all, load=load_all))
