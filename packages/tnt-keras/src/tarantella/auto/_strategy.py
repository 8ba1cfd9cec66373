"""ParallelStrategy.AUTO in the strategy registry: plan on rank 0, broadcast the plan,
build the chosen layout with its own strategy.

Every rank first times the job's allreduce together (alpha, beta: ``_comm.measure_network``),
unless ``network=`` gives them. Rank 0 alone profiles and searches (the measurements differ
from rank to rank), so every rank builds the same layout. ``plan=`` (a
:class:`~._plan.Plan`, edited or not) skips the search.
"""

from __future__ import annotations

import keras

from .._core import runtime as _runtime
from .._core.deferred import has_deferred, materialise
from .._core.strategy import ParallelStrategy, Strategy, register, strategy_for
from ._comm import Network, measure_network
from ._plan import Plan
from ._search import plan_parallel

#: ``memory_budget=`` is every strategy's (tnt.Model passes it in).
OPTIONS = ("plan", "global_batch_size", "network", "sequence_length")


class AutoError(ValueError):
    """ParallelStrategy.AUTO was not given what it needs to plan."""


def _agreed_plan(model: keras.Model, options: dict) -> Plan:
    import tnt_comm

    size = _runtime.get_size()
    plan = options.get("plan")
    if plan is not None:
        if not isinstance(plan, Plan):
            raise AutoError(f"tnt.Model(plan=...) takes the Plan of tnt.plan_parallel, got {type(plan).__name__}.")
        if plan.num_ranks != size:
            raise AutoError(f"tnt.Model(plan=...): the plan is for {plan.num_ranks} rank(s) but the job has {size}; "
                            f"make it with tnt.plan_parallel(model, num_ranks={size}, ...).")
        return plan
    batch = options.get("global_batch_size")
    if batch is None:
        raise AutoError("tnt.Model(parallel_strategy=ParallelStrategy.AUTO) needs global_batch_size= (the batch "
                        "size the dataset is batched with) to plan, or plan=tnt.plan_parallel(...).")
    network = options.get("network")
    if network is not None and not isinstance(network, Network):
        raise AutoError(f"tnt.Model(network=...) takes a tnt.auto.Network(alpha_s=..., beta_Bps=...), got "
                        f"{type(network).__name__}; leave it out to measure this job's network.")
    if size == 1:
        return plan_parallel(model, 1, batch, options.get("memory_budget"), network=network,
                             sequence_length=options.get("sequence_length"))
    if network is None:
        network = measure_network()  # collective: every rank, before rank 0 plans alone
    result: Plan | Exception | None = None
    if _runtime.get_rank() == 0:
        try:
            result = plan_parallel(model, size, batch, options.get("memory_budget"), network=network,
                                   sequence_length=options.get("sequence_length"))
        except Exception as e:  # every rank raises rank 0's error, none hangs
            result = e
    result = tnt_comm.broadcast_object(result, root=0)
    if isinstance(result, Exception):
        raise result
    return result


def build_auto(model: keras.Model, member: ParallelStrategy, options: dict) -> keras.Model:
    """The model of the layout the planner chose (or ``plan=`` names), already built."""
    from ..data_parallel import Model  # the wrapper (DATA with its sharding level)

    plan = _agreed_plan(model, options)
    chosen, chosen_options = plan.model_options()
    if plan.layout.stages > 1 and plan.layout.split_after is not None:
        from .. import pipelining  # the stages the plan predicted (bytes- or time-balanced)

        chosen_options["pipeline_plan"] = pipelining.plan(model, split_after=list(plan.layout.split_after))
    built = None
    if chosen is not ParallelStrategy.DATA:
        built = strategy_for(chosen).build(model, chosen, chosen_options)
    if built is None:
        level = chosen_options.get("sharding", 0) if chosen is ParallelStrategy.DATA else 0
        # Built under deferred_variables(): at level 3 (several replicas) each replica gives
        # values only to what it stores (tnt.Model does); else every replica holds it whole.
        if has_deferred(model) and not (level == 3 and _runtime.get_size() > 1):
            materialise(model)
        built = Model(model, sharding=level, memory_budget=options.get("memory_budget"))
        built._tnt_auto_built = True  # tnt.Model.__init__ runs again on it: keep it as it is
    built._tnt_plan = plan
    return built


def load_auto(filepath, member: ParallelStrategy, options: dict, **kwargs) -> keras.Model:
    """AUTO plans a model, not a file: say how to load one."""
    raise AutoError("tnt.models.load_model(parallel_strategy=AUTO) is not supported: load the file with "
                    "keras.saving.load_model (or under tnt.deferred_variables() via tnt.models.load_model with "
                    "a strategy), then wrap it: tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.AUTO, "
                    "global_batch_size=...).")


register(Strategy(name="auto", handles=(ParallelStrategy.AUTO,), options=OPTIONS, error=AutoError,
                  build=build_auto, load=load_auto))
