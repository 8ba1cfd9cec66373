"""Every rank of a tensor-parallel job must hold the same plan, compared by position.

Keras numbers auto-named layers per process (a rank that built another model first has
``dense_4`` where the others have ``dense_2``), so plans are compared by each layer's place
in the graph walk, class, split and size, never by name. The comparison is an allgather:
every rank sees every rank's plan and all of them raise the same error together (a check
failing on one rank only would leave the others waiting in their next collective).
"""

from __future__ import annotations

import tnt_comm

from .._core import runtime as _runtime
from .._core.errors import TensorParallelError
from ._plan import Plan


def plan_signature(plan: Plan) -> list[tuple[str, str, int]]:
    """(class, split, weights) of each planned layer, in graph order: names left out."""
    return [(s.class_name, s.kind, s.params) for s in plan.layers] + [("Dropout", "mask slice", len(plan.split_dropouts))]


def first_difference(signatures: list[list]) -> tuple[int, int] | None:
    """(rank, position) of the first signature differing from rank 0's, or None."""
    reference = signatures[0]
    for rank, theirs in enumerate(signatures):
        if theirs != reference:
            diff = next((i for i, (a, b) in enumerate(zip(theirs, reference)) if a != b), min(len(theirs), len(reference)))
            return rank, diff
    return None


def check_same_plan(plan: Plan) -> None:
    """Raise the same TensorParallelError on every rank unless all ranks' plans agree (collective)."""
    if _runtime.get_size() == 1:
        return
    mine = plan_signature(plan)
    everyone = tnt_comm.allgather_object(mine)
    found = first_difference(everyone)
    if found is None:
        return
    rank, pos = found
    def at(sig):
        return sig[pos] if pos < len(sig) else "nothing"
    names = [s.name for s in plan.layers]
    here = f" (here {names[pos]!r})" if pos < len(names) else ""
    raise TensorParallelError(
        f"rank {rank} computed another tensor-parallel plan than rank 0: layer #{pos} in graph order{here} is "
        f"{at(everyone[rank])} on rank {rank} but {at(everyone[0])} on rank 0 (class, split, weights). Every "
        "rank must build the same model (same layers, sizes and arguments) and pass the same plan; layer names "
        "may differ.")


__all__ = ["check_same_plan", "first_difference", "plan_signature"]
