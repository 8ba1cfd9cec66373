"""``tnt.tensor_parallel``: split large layers' weights over a group of ranks.

    plan = tnt.tensor_parallel.plan(keras_model, tensor_parallel_size=2)
    plan.summary()
    model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.TENSOR,
                      tensor_parallel_size=2)
    model.save("m.keras")          # a serial Keras file
    model = tnt.models.load_model("m.keras", parallel_strategy=tnt.ParallelStrategy.TENSOR,
                                  tensor_parallel_size=q)   # any q

See docs/tensor_parallel.md.
"""

from __future__ import annotations

from ._collectives import TensorGroup, copy_to_group, gather_last_axis, reduce_from_group
from ._errors import TensorParallelError
from ._layers import ColumnDense, HeadsAttention, RowDense, SliceDropout, VocabEmbedding
from ._model import TensorParallelModel, tensor_parallel_model
from ._plan import KINDS, LayerSplit, Plan, plan
from ._saving import load_model

__all__ = [
    "KINDS",
    "ColumnDense",
    "HeadsAttention",
    "LayerSplit",
    "Plan",
    "RowDense",
    "SliceDropout",
    "TensorGroup",
    "TensorParallelError",
    "TensorParallelModel",
    "VocabEmbedding",
    "copy_to_group",
    "gather_last_axis",
    "load_model",
    "plan",
    "reduce_from_group",
    "tensor_parallel_model",
]
