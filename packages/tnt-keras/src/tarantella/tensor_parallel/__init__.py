"""``tnt.tensor_parallel``: split large layers' weights over a group of ranks.

    plan = tnt.tensor_parallel.plan(keras_model, tensor_parallel_size=2)
    plan.summary()
    model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.TENSOR,
                      tensor_parallel_size=2)
    plan.replicate("ffn_up").split("head", "column+allgather")   # edit, then pass it back:
    model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.ALL,   # N / 2 replicas
                      tensor_parallel_size=2, tensor_parallel_plan=plan)     # (or a LayoutMap)
    model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.ALL,   # N / (p * 2) replicas
                      tensor_parallel_size=2, num_pipeline_stages=p)         # of p stages of 2 ranks
    model.save("m.keras")          # TENSOR: a serial Keras file
    model = tnt.models.load_model("m.keras", parallel_strategy=tnt.ParallelStrategy.TENSOR,
                                  tensor_parallel_size=q)   # any q

See docs/tensor_parallel.md.
"""

from __future__ import annotations

from .._core.errors import TensorParallelError
from .._core.mesh import Mesh as Layout  # the old name of the one mesh
from .._core.mesh import check_layout
from ._collectives import TensorGroup, copy_to_group, gather_last_axis, reduce_from_group
from ._layers import ColumnDense, HeadsAttention, RowDense, SliceDropout, VocabEmbedding
from ._layout_map import from_layout_map
from ._model import TensorParallelModel
from ._plan import KINDS, SUPPORTED, LayerSplit, Plan, plan, plan_from_kinds
from ._strategy import load_model  # also registers TENSOR (ALL: tnt.hybrid)
from ._xla import allow_cpu_clusters as _allow_cpu_clusters

_allow_cpu_clusters()  # TF_XLA_FLAGS is read when the first function runs (see _xla)

__all__ = [
    "KINDS",
    "SUPPORTED",
    "ColumnDense",
    "HeadsAttention",
    "LayerSplit",
    "Layout",
    "Plan",
    "RowDense",
    "SliceDropout",
    "TensorGroup",
    "TensorParallelError",
    "TensorParallelModel",
    "VocabEmbedding",
    "check_layout",
    "copy_to_group",
    "from_layout_map",
    "gather_last_axis",
    "load_model",
    "plan",
    "plan_from_kinds",
    "reduce_from_group",
]
