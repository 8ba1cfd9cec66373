"""ParallelStrategy.PIPELINING in the strategy registry: its options, build and load.

On one rank, or when the plan has one stage, the data-parallel wrapper runs the model
(markers are identities there); the plan and the options are still checked first, so a
script fails alike under ``python`` and under the launcher.
"""

from __future__ import annotations

import keras

from .._core import internals as _internals
from .._core import runtime as _runtime
from .._core.deferred import materialise
from .._core.errors import PipelineError
from .._core.graph import model_graph
from .._core.serial_files import deferred_from_file, open_model_file
from .._core.split_layer import SplitLayer
from .._core.strategy import ParallelStrategy, Strategy, register
from ._interleaved import check_interleaved_options, check_interleaved_strategy, chunk_plan
from ._model import PipelinedModel, check_micro_batches
from ._plan import stages_from_markers
from ._remat import check_remat
from ._saving import read_stage_state
from ._schedule import check_schedule, check_virtual_stages

#: The options of a pipeline, declared once (ALL takes them too).
OPTIONS = ("num_pipeline_stages", "num_micro_batches", "pipeline_schedule", "pipeline_plan", "remat",
           "virtual_stages")


def check_options(options: dict) -> None:
    """Schedule and micro-batch count, checked on every rank count."""
    check_schedule(options.get("pipeline_schedule", "1f1b"))
    check_virtual_stages(options.get("pipeline_schedule", "1f1b"), options.get("virtual_stages"))
    check_remat(options.get("remat"))
    if options.get("num_micro_batches") is not None:
        check_micro_batches(options["num_micro_batches"])


def build(model: keras.Model, member: ParallelStrategy, options: dict) -> PipelinedModel | None:
    """This rank's stage of ``model`` (None: the data-parallel wrapper runs it whole)."""
    options = dict(options)
    check_options(options)
    check_interleaved_strategy(options.get("pipeline_schedule", "1f1b"), member.value,
                               options.get("virtual_stages"))
    plan, p, _ = chunk_plan(model, options.get("pipeline_schedule", "1f1b"), options.get("num_pipeline_stages"),
                            options.get("virtual_stages"), options.pop("pipeline_plan", None))
    options.pop("num_pipeline_stages", None)
    if options.get("num_micro_batches") is not None:  # checked on one rank too: fails alike everywhere
        check_interleaved_options(options.get("pipeline_schedule", "1f1b"), member.value, p,
                                  options["num_micro_batches"])
    if _runtime.get_size() == 1 or p == 1:
        materialise(model)  # built under deferred_variables: the whole model trains here
        return None
    return PipelinedModel(model, parallel_strategy=member.value, pipeline_plan=plan, **options)


def load(filepath, member: ParallelStrategy, options: dict, **kwargs) -> keras.Model | None:
    """A file into q stages (None: one rank or one stage, loaded data-parallel)."""
    if "pipeline_plan" in options:
        raise PipelineError("tnt.models.load_model takes num_pipeline_stages=, not pipeline_plan= (the plan "
                            "is made from the file's model); load, then wrap with tnt.Model(..., pipeline_plan=).")
    check_options(options)
    return load_model(filepath, parallel_strategy=member, **options, **kwargs)


def load_model(filepath, *, parallel_strategy, num_pipeline_stages=None, num_micro_batches=None,
               pipeline_schedule: str = "1f1b", remat: str | None = None, virtual_stages: int | None = None,
               sharding: int = 0, custom_objects=None,
               compile: bool = True,
               safe_mode: bool = True, **kwargs):
    """Load a ``.keras`` file (pipelined or serial save) into ``num_pipeline_stages`` stages.

    Each rank builds the model's shapes only (deferred variables), plans the stages, and
    reads its own stage's weights and optimizer variables from the file.
    """
    strategy = getattr(parallel_strategy, "value", parallel_strategy)
    with open_model_file(filepath) as (local, archive):
        legacy = archive is None  # an HDF5 (.h5) model: Keras loads it whole
        full = keras.saving.load_model(local, custom_objects=custom_objects, compile=compile, **kwargs) \
            if legacy else deferred_from_file(archive, custom_objects, compile, safe_mode)
        v = check_virtual_stages(pipeline_schedule, virtual_stages)
        chunks = None if num_pipeline_stages is None else num_pipeline_stages * v
        pipeline_plan, p, _ = chunk_plan(full, pipeline_schedule, num_pipeline_stages, virtual_stages,
                                         use_markers=_markers_agree(full, chunks))
        if _runtime.get_size() == 1 or p == 1:
            return None  # one rank or one stage: the caller loads it data-parallel
        model = PipelinedModel(full, parallel_strategy=strategy, num_micro_batches=num_micro_batches,
                               pipeline_schedule=pipeline_schedule, pipeline_plan=pipeline_plan, remat=remat,
                               virtual_stages=virtual_stages, sharding=sharding)
        if not legacy:
            full_optimizer = full.optimizer if compile and getattr(full, "optimizer", None) is not None else None
            read_stage_state(model, full, full_optimizer, _internals.weights_store(local, archive))
    del full
    return model


def _markers_agree(model, num_pipeline_stages) -> bool:
    """Use the file's SplitLayers unless the caller asks for another number of stages."""
    if num_pipeline_stages is None:
        return True
    graph = model_graph(model, flatten_nested=True)  # markers inside a nested backbone count
    if not any(isinstance(c.layer, SplitLayer) for c in graph.calls):
        return True
    return max(stages_from_markers(graph)) + 1 == num_pipeline_stages


register(Strategy(name="pipelining", handles=(ParallelStrategy.PIPELINING,), options=OPTIONS,
                  error=PipelineError, build=build, load=load))
