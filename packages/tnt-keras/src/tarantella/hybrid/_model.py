"""ParallelStrategy.ALL with pipeline stages of tensor groups: N = replicas x p x t.

``rank = (replica * p + stage) * t + shard`` (the mesh: docs/architecture.md, "Layer
parallelism"). The composition is pipelining's model with its stage builder swapped
(``PipelinedModel``'s ``_stage_builder``):

- the stage: pipelining builds the stage's Keras model from clones of its layers
  (``build_stage``); the ranks of the tensor group make it identical (broadcast from
  shard 0: initial values, dropout seeds), then it is split as TENSOR splits a whole
  model (``shard_model``), each rank keeping its slices. Its inputs and outputs — the
  pipeline's boundary tensors — are whole and the same on every rank of the group,
  which is why a column/row pair must sit in one stage (its activations between are split);
- the transport is pipelining's own on the mesh of t > 1: point-to-point traffic goes
  between the same shard of neighbouring stages; the pipeline group of a rank is its
  replica's stages of the same shard, its replica group the same stage and shard in the
  other replicas (stage gradients and metric states are summed there by pipelining's
  own step end).

Everything else — schedules, micro-batches, loss weighting, logs, predict — is
pipelining's, unchanged: every rank of a tensor group runs the same schedule on the same
data, so the in-graph collectives of its stage's shards are issued in the same order.
"""

from __future__ import annotations

import keras
import numpy as np

import tnt_comm

from .._core import runtime as _runtime
from .._core.errors import TensorParallelError
from .._core.mesh import groups
from .._core.serial_files import optimizer_state
from ..pipelining import PipelinedModel, StageModel, build_stage
from ..pipelining import Plan as PipelinePlan
from ..tensor_parallel.parts import (
    COLUMN,
    SPLIT_AXES,
    GroupMember,
    Plan,
    TensorGroup,
    assign_slices,
    digest,
    shard_model,
    split_variables,
    var_name,
)


def check_pairs_in_one_stage(tensor_plan: Plan, pipeline_plan: PipelinePlan) -> None:
    """A TensorParallelError naming the fix if a column/row pair spans two stages."""
    for split in tensor_plan.layers:
        if split.kind != COLUMN:
            continue
        first, second = pipeline_plan.stage_of_layer(split.name), pipeline_plan.stage_of_layer(split.partner)
        if first != second:
            raise TensorParallelError(
                f"layer {split.name!r} (column-split) is on pipeline stage {first} and its row-split partner "
                f"{split.partner!r} on stage {second}: the activations between them are split over the "
                "tensor group and cannot cross stages. Move the SplitLayer (or the split point) so that both "
                f"are on one stage, or keep the pair whole with plan.replicate({split.name!r}).")


class _StageBuilder:
    """Builds this rank's tensor-split stage (PipelinedModel's ``_stage_builder``)."""

    def __init__(self, tensor_plan: Plan) -> None:
        self.tensor_plan = tensor_plan
        self.tensor_parallel_size = tensor_plan.tensor_parallel_size
        self.group: TensorGroup | None = None
        self.shards: dict = {}

    def __call__(self, pipeline_plan: PipelinePlan, transport) -> StageModel:
        self.group = TensorGroup(groups(transport.mesh).tensor)  # adjacent ranks: one stage of one replica
        whole = build_stage(pipeline_plan, transport.stage)
        if self.group.comm is not None:  # one stage, one start: shard 0's values and seeds
            for var in whole.model.variables:
                value = np.ascontiguousarray(var.numpy())
                var.assign(self.group.comm.broadcast(value, 0).reshape(value.shape))
        local = shard_model(whole.model, self.tensor_plan, self.group, self.shards)
        # Layers reaching no output (BERT's pooler under a head) are held whole by the stage,
        # as in pipelining: trained with zero gradient and saved with their own values.
        local.tnt_unused_layers = list(getattr(whole.model, "tnt_unused_layers", ()))
        assign_slices(split_variables(whole.model, self.shards, self.tensor_plan), self.group)
        return StageModel(whole.index, local, whole.data_inputs, whole.inputs, whole.outputs, whole.is_last)


class TensorPipelinedModel(GroupMember, PipelinedModel):
    """This rank's shards of its pipeline stage (ALL with ``num_pipeline_stages`` > 1 and
    ``tensor_parallel_size`` > 1). Pipelining's model; ``get_weights`` and ``save`` give
    the whole serial model (shards joined, stages gathered), ``set_weights`` takes it."""

    def __init__(self, model: keras.Model, *, tensor_plan: Plan, pipeline_plan: PipelinePlan,
                 **pipeline_options) -> None:
        check_pairs_in_one_stage(tensor_plan, pipeline_plan)
        mine = [(s.name, s.kind) for s in tensor_plan.layers]
        everyone = tnt_comm.allgather_object(mine) if _runtime.get_size() > 1 else [mine]
        differing = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
        if differing:  # every rank sees it and raises: none is left waiting
            raise TensorParallelError(
                f"rank(s) {differing} computed another tensor-parallel plan than rank 0; every rank must "
                "build the same model with the same layer names: Keras numbers auto-named layers and "
                "models per process, so a rank that built another Keras model first (e.g. a serial "
                "reference on the master only) names them differently. Build the model to wrap first "
                "on every rank, or give its layers and nested models explicit names.")
        builder = _StageBuilder(tensor_plan)
        super().__init__(model, parallel_strategy="all", pipeline_plan=pipeline_plan, _stage_builder=builder,
                         **pipeline_options)
        self.tensor_plan = tensor_plan
        object.__setattr__(self, "_tnt_builder", builder)  # its shards: not tracked twice

    # -- what this rank holds ----------------------------------------------------------------
    @property
    def group(self) -> TensorGroup:
        """The tensor group of this rank's stage."""
        return self._tnt_builder.group

    @property
    def _tnt_shards(self) -> dict:
        return self._tnt_builder.shards

    def _split_axes(self, layer) -> dict[str, int]:
        return SPLIT_AXES[self.tensor_plan.kind(layer.name)] if layer.name in self._tnt_shards else {}

    def _tnt_stage_payload(self, with_optimizer: bool) -> dict:
        """This stage's serial-shaped weights by layer (and optimizer state by pipelining's
        keys), shards joined over the tensor group (collective on the group)."""
        weights, split = {}, {}
        for layer in self.stage_layers():
            axes = self._split_axes(layer)
            for j, w in enumerate(layer.weights):
                if var_name(w, layer) in axes:
                    split[f"{layer.name}/{j}"] = axes[var_name(w, layer)]
            if layer.weights:
                weights[layer.name] = [self._gather(np.asarray(w.numpy()), axes.get(var_name(w, layer)))
                                       for w in layer.weights]
        state = {}
        if with_optimizer:
            sharded = self._tnt_stage.shards is not None  # the replicas' slots, on replica 0 (collective)
            whole = self._tnt_stage.whole_optimizer_state() if sharded else \
                optimizer_state(self.optimizer, self.stage_model)
            for key, value in (whole or {}).items():
                state[key] = self._gather(value, split.get(key.split("|", 1)[0]) if "|" in key else None)
        return {"weights": weights, "optimizer": state}

    def _tnt_part(self, layer, variable, value: np.ndarray) -> np.ndarray:
        """This rank's slice of a split layer's serial ``value`` (all of it elsewhere)."""
        axis = self._split_axes(layer).get(var_name(variable, layer))
        return value if axis is None else np.split(value, self.group.size, axis=axis)[self.group.rank]

    def replicated_checksum(self) -> str:
        """A digest of this rank's replicated variables (equal on the ranks of a tensor group)."""
        return digest([v for layer in self.stage_layers() if layer.name not in self._tnt_shards
                       for v in layer.weights])

    # -- compile ---------------------------------------------------------------------------------
    def compile(self, *args, **kwargs) -> None:
        """Pipelining's compile; norms of whole gradients and loss scaling are refused (a
        rank holds only shards of the split layers' gradients)."""
        resolved = self._tnt_own_compile_arguments(args, kwargs)
        resolved["optimizer"] = keras.optimizers.get(resolved["optimizer"])
        inner = getattr(resolved["optimizer"], "inner_optimizer", resolved["optimizer"])
        if getattr(inner, "clipnorm", None) or getattr(inner, "global_clipnorm", None):
            raise TensorParallelError(
                "clipnorm/global_clipnorm compute norms of whole gradients, but a rank holds only shards of "
                "the split layers' gradients. Use clipvalue=, or tensor_parallel_size=1 (pipelining alone).")
        super().compile(**resolved)
        if self.loss_scaled:
            raise TensorParallelError(
                "a LossScaleOptimizer (mixed_float16) decides whether to skip a step from finite gradients, "
                "which a rank of a tensor group sees only shards of. Train in float32 with pipeline stages "
                "of tensor groups, or use tensor_parallel_size=1 (pipelining alone) or "
                "num_pipeline_stages=1 (data replicas of tensor groups).")

    # -- files -------------------------------------------------------------------------------------
    def _tnt_gather_serial(self, with_optimizer: bool = True) -> keras.Model | None:
        """The whole serial model (with optimizer state) on the master, None elsewhere;
        every rank calls it."""
        payloads = self.transport.pipeline_allgather_object(self._tnt_stage_payload(with_optimizer))
        if not _runtime.is_master_rank():
            return None
        with tnt_comm.long_local_work():
            return self._tnt_fill_serial(payloads, with_optimizer)

    def _tnt_streamed(self, kind: str, with_optimizer: bool):
        """None: stages of tensor groups are gathered whole on the master (their split
        variables are joined first), not streamed yet."""
        return None

    def load_weights(self, filepath, *args, **kwargs) -> None:
        """Not available yet with pipeline stages of tensor groups (see the error)."""
        raise TensorParallelError(
            "load_weights / BackupAndRestore are not available yet for pipeline stages of tensor groups. "
            "Load the file into a model first (keras.saving.load_model on every rank) and wrap that "
            "model with tnt.Model(..., parallel_strategy=ALL, num_pipeline_stages=p, tensor_parallel_size=t), "
            "or train with num_pipeline_stages=1 or tensor_parallel_size=1, which resume from backups.")


__all__ = ["TensorPipelinedModel", "check_pairs_in_one_stage"]
