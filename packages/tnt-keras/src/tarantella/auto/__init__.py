"""``tnt.plan_parallel`` and ``ParallelStrategy.AUTO``: choose d replicas x p stages x t
tensor group (and DATA's sharding level, the pipeline's micro-batches) from a measured
per-layer profile and the alpha-beta communication model, within a per-rank memory budget
(docs/auto.md).

    plan = tnt.plan_parallel(keras_model, num_ranks=4, global_batch_size=64, memory_budget="2GiB")
    plan.summary()
    model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.AUTO,
                      global_batch_size=64, memory_budget="2GiB")     # or plan=plan
"""

from __future__ import annotations

from ._budget import default_budget
from ._comm import Network, measure_network
from ._cost import Estimate
from ._layout import Layout
from ._plan import Candidate, Plan
from ._profile import LayerCost, Profile, profile
from ._search import plan_parallel
from ._stages import StagePlanError, time_balanced_plan
from ._strategy import AutoError  # also registers AUTO

__all__ = [
           "AutoError",
           "Candidate",
           "Estimate",
           "LayerCost",
           "Layout",
           "Network",
           "Plan",
           "Profile",
           "StagePlanError",
           "default_budget",
           "measure_network",
           "plan_parallel",
           "profile",
           "time_balanced_plan",
]
