"""The options of the interleaved schedule, checked before any stage is built.

Interleaved 1F1B (``pipeline_schedule="interleaved"``, ``virtual_stages=v``) plans the model
into p * v chunks; stage (rank) r holds chunks r, r + p, ... (``_schedule``). This module
turns the user's options into that plan and p, with an error naming the fix for each
combination that cannot run.
"""

from __future__ import annotations

from .._core.errors import PipelineError
from .._core.graph import model_graph
from ._plan import Plan
from ._plan import plan as make_plan
from ._schedule import INTERLEAVED, check_interleaved_micro_batches, check_virtual_stages


def chunk_plan(model, schedule: str, num_pipeline_stages: int | None, virtual_stages: int | None,
               pipeline_plan: Plan | None = None, **plan_kwargs) -> tuple[Plan, int, int]:
    """(plan, p, v): the plan of ``model`` (its stages are the p * v chunks when interleaved)."""
    v = check_virtual_stages(schedule, virtual_stages)
    if v == 1:
        plan = pipeline_plan or make_plan(model, num_pipeline_stages, **plan_kwargs)
        return plan, plan.num_stages, 1
    if pipeline_plan is None and num_pipeline_stages is not None:
        calls = sum(not c.is_split for c in model_graph(model, flatten_nested=True).calls)
        if num_pipeline_stages * v > calls:
            raise PipelineError(
                f"pipeline_schedule='interleaved' cuts the model into num_pipeline_stages x virtual_stages = "
                f"{num_pipeline_stages} x {v} = {num_pipeline_stages * v} chunks, but model {model.name!r} has "
                f"only {calls} layer calls; pass virtual_stages={max(calls // num_pipeline_stages, 1)} or less "
                "(or fewer stages).")
    plan = pipeline_plan or make_plan(model, None if num_pipeline_stages is None else num_pipeline_stages * v,
                                      **plan_kwargs)
    if plan.num_stages % v:
        raise PipelineError(
            f"pipeline_schedule='interleaved' with virtual_stages={v} needs the model cut into a multiple of "
            f"{v} chunks, but its plan (SplitLayer markers or pipeline_plan) has {plan.num_stages}; mark "
            f"num_pipeline_stages x {v} chunks or change virtual_stages.")
    p = plan.num_stages // v
    if num_pipeline_stages is not None and num_pipeline_stages != p:
        raise PipelineError(f"the plan has {plan.num_stages} chunks = {plan.num_stages // v} stages x "
                            f"virtual_stages={v}, but num_pipeline_stages={num_pipeline_stages}; make them agree.")
    return plan, p, v


def check_interleaved_strategy(schedule: str, strategy: str, virtual_stages=None) -> None:
    """The interleaved schedule runs with ParallelStrategy.PIPELINING only (``strategy``:
    the strategy's value, "all" also for pipelines of tensor groups)."""
    if schedule not in INTERLEAVED and virtual_stages in (None, 1):
        return
    if strategy != "pipelining":
        raise PipelineError(
            "pipeline_schedule='interleaved' runs with ParallelStrategy.PIPELINING only (one pipeline, "
            "no data replicas or tensor groups yet); use ParallelStrategy.PIPELINING, or "
            "pipeline_schedule='1f1b' (or 'zb-h1') with ParallelStrategy.ALL.")


def check_interleaved_options(schedule: str, strategy: str, num_stages: int, num_micro_batches: int) -> None:
    """What the interleaved schedule cannot run: ParallelStrategy.ALL, a count of
    micro-batches that is no multiple of p."""
    check_interleaved_strategy(schedule, strategy)
    if schedule in INTERLEAVED:
        check_interleaved_micro_batches(num_stages, num_micro_batches)
