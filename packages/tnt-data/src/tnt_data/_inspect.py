"""Find the global batch of a pipeline: the batch its elements come out of."""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from tnt_data._tfgraph import Node, parse
from tnt_data.errors import DistributionError

# Transformations that may sit between the global batch and the end of the pipeline:
# they pass whole batches through (or drop / reorder / repeat whole batches).
ABOVE_BATCH = frozenset(
    {"map", "filter", "prefetch", "cache", "repeat", "take", "skip", "options",
     "assert_cardinality", "shuffle", "zip", "concatenate"}
)
BATCHES = frozenset({"batch", "padded_batch"})


@dataclass(frozen=True)
class PipelineInfo:
    """What tnt_data sees in a dataset.

    ``steps_per_epoch`` is the number of global batches of one pass over the dataset, or
    None when TensorFlow cannot tell (a filter) or the dataset is infinite (a repeat());
    ``cardinality`` is ``dataset.cardinality()`` with TF's -1 (infinite) / -2 (unknown).
    """

    batched: bool
    global_batch_size: int | None
    drop_remainder: bool | None
    batch_transformation: str | None  # "batch" or "padded_batch"
    cardinality: int
    steps_per_epoch: int | None


def find_batches(root: Node) -> list[Node]:
    """The batch transformations whose output reaches the end of the pipeline unchanged.

    Several only through zip/concatenate. Empty when the pipeline yields single samples.
    """
    found: list[Node] = []
    unbatched: list[Node] = []

    def walk(node: Node) -> None:
        if node.kind in BATCHES:
            found.append(node)
        elif node.kind in ABOVE_BATCH:
            for i in node.inputs:
                walk(i)
        elif node.kind == "opaque" and _has_batch_below(node):
            raise DistributionError(
                f"cannot find the global batch size: the transformation {node.label} comes "
                f"after a batch and tnt_data does not know how it changes batches. Move it "
                f"before the batch, or pass tnt_distribute_dataset=False and shard by hand."
            )
        else:
            unbatched.append(node)

    walk(root)
    if found and unbatched:
        raise DistributionError(
            f"part of the pipeline is batched ({found[0].label}) and part is not "
            f"({unbatched[0].label}, e.g. in a zip or concatenate). Batch every branch "
            f"with the same global batch size, or batch after combining them."
        )
    sizes = {n.params["batch_size"] for n in found}
    if len(sizes) > 1:
        raise DistributionError(
            f"the pipeline combines batches of different sizes {sorted(sizes)} (zip or "
            f"concatenate of differently batched datasets): there is no single global "
            f"batch size. Batch every branch with the same size."
        )
    return found


def _has_batch_below(node: Node) -> bool:
    return any(i.kind in BATCHES or _has_batch_below(i) for i in node.inputs)


def _cardinality(dataset: tf.data.Dataset) -> int:
    return int(dataset.cardinality().numpy())


def inspect(dataset: tf.data.Dataset) -> PipelineInfo:
    """Global batch size, drop_remainder and steps per epoch of a (batched) dataset."""
    return inspect_graph(parse(dataset))


def inspect_graph(root: Node) -> PipelineInfo:
    batches = find_batches(root)
    card = _cardinality(root.dataset)
    steps = card if card >= 0 else None
    if not batches:
        return PipelineInfo(False, None, None, None, card, steps)
    size = int(batches[0].params["batch_size"])
    drops = {n.params["drop_remainder"] for n in batches}
    kinds = {n.kind for n in batches}
    return PipelineInfo(
        batched=True,
        global_batch_size=size,
        drop_remainder=drops.pop() if len(drops) == 1 else None,
        batch_transformation="padded_batch" if "padded_batch" in kinds else "batch",
        cardinality=card,
        steps_per_epoch=steps,
    )
