"""The pieces of layer parallelism that other layouts compose (``tarantella.hybrid``:
pipeline stages of tensor groups) — public to the package, not part of the user API.

Split a whole model into this rank's shards (``shard_model``), pair its variables with
the shards' (``split_variables``), give each shard its slice (``assign_slices``), and
answer what a rank of a tensor group is (``GroupMember``). Kept here, in one module, so
that no other subpackage reaches into tensor_parallel's private modules
(docs/architecture.md, "Import rules").
"""

from __future__ import annotations

from ._collectives import TensorGroup
from ._layout_map import as_plan
from ._model import (
    GroupMember,
    TensorParallelModel,
    assign_slices,
    digest,
    shard_model,
    split_variables,
)
from ._plan import COLUMN, SPLIT_AXES, Plan, check_model, var_name
from ._strategy import OPTIONS, load_model, size_from_options

__all__ = [
    "COLUMN",
    "OPTIONS",
    "SPLIT_AXES",
    "GroupMember",
    "Plan",
    "TensorGroup",
    "TensorParallelModel",
    "as_plan",
    "assign_slices",
    "check_model",
    "digest",
    "load_model",
    "shard_model",
    "size_from_options",
    "split_variables",
    "var_name",
]
