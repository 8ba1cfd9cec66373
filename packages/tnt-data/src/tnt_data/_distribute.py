"""distribute(): one rank's micro-batches of a pipeline batched with the global batch size.

Two ways to get them, with identical results:
- after the batch: every rank runs the whole pipeline and keeps its slice of each global
  batch (always possible, exact by construction);
- early: every rank keeps its samples right after the last shuffle/repeat/filter, before
  the 1:1 maps that precede the batch, and batches them with its micro-batch size, so it
  runs those maps on about 1/size of the samples (see _early.py). Chosen automatically
  where it is provably identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import tensorflow as tf

from tnt_data import _plan
from tnt_data._early import EarlyPlan, call, early_batches, plan_early
from tnt_data._inspect import inspect_graph
from tnt_data._slicing import StepSizes, check_batched_spec, slicer
from tnt_data._tfgraph import Node, parse, rebuild
from tnt_data.errors import DistributionError

Split = Literal["auto", "early", "after_batch"]

#: Seed of the first unseeded shuffle when distribute() gets no shuffle_seed.
DEFAULT_SHUFFLE_SEED = 5524052
#: TensorFlow's seed pair for ``shuffle(seed=s)`` without a global seed is (87654321, s);
#: tnt_data uses the same pair, so an unseeded shuffle behaves as ``shuffle(seed=s)``.
GRAPH_SEED = 87654321


@dataclass(frozen=True)
class Strategy:
    """How distribute() splits a pipeline: ``mode`` is "early" or "after_batch"."""

    mode: str
    reason: str


def split_strategy(dataset: tf.data.Dataset, *, size: int, split: Split = "auto") -> Strategy:
    """Say how distribute() would split ``dataset`` across ``size`` ranks, and why."""
    _plan.check_rank_size(0, size)
    return _strategy(parse(dataset), size, split)[0]


def _strategy(root: Node, size: int, split: Split) -> tuple[Strategy, EarlyPlan | None]:
    if split not in ("auto", "early", "after_batch"):
        raise DistributionError(
            f"split must be 'auto', 'early' or 'after_batch', got {split!r}."
        )
    if split == "after_batch" or size == 1:
        return Strategy("after_batch", f"split={split!r}" if size > 1 else "one rank"), None
    early, reason = plan_early(root, size, allow_post_maps=split == "early")
    if early is None:
        if split == "early":
            raise DistributionError(
                f"split='early' is not possible for this pipeline: {reason}. Use "
                f"split='auto' (splits after the batch here, with the same result)."
            )
        return Strategy("after_batch", reason), None
    return Strategy("early", reason), early


def _unseeded_shuffles(root: Node) -> list[Node]:
    """Shuffles without any seed, in a fixed order (sources first)."""
    out: list[Node] = []
    seen: set[int] = set()

    def visit(node: Node) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        for i in node.inputs:
            visit(i)
        if node.kind == "shuffle" and node.params["seed"] == 0 and node.params["seed2"] == 0:
            out.append(node)

    visit(root)
    return out


def _all_nodes(root: Node) -> list[Node]:
    out, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            out.append(node)
            stack.extend(node.inputs)
    return out


def _rebuildable(root: Node) -> set[Node]:
    """Nodes with no transformation tnt_data cannot rebuild between them and the end."""
    parents: dict[int, list[Node]] = {}
    for node in _all_nodes(root):
        for i in node.inputs:
            parents.setdefault(id(i), []).append(node)
    memo: dict[int, bool] = {}

    def ok(node: Node) -> bool:
        if id(node) not in memo:
            memo[id(node)] = False  # (no cycles in a pipeline; guards recursion)
            memo[id(node)] = node.kind != "opaque" and all(ok(p) for p in parents.get(id(node), []))
        return memo[id(node)]

    return {n for n in _all_nodes(root) if ok(n)}


class _Builder:
    """Rebuilds the transformations that must change, and everything above them."""

    def __init__(
        self,
        overrides: dict[Node, dict[str, Any]],
        special: dict[Node, Callable[[], tf.data.Dataset]],
    ) -> None:
        self.overrides, self.special = overrides, special
        self._changed: dict[int, bool] = {}
        self._built: dict[int, tf.data.Dataset] = {}

    def changed(self, node: Node) -> bool:
        if id(node) not in self._changed:
            self._changed[id(node)] = (
                node in self.overrides
                or node in self.special
                or any(self.changed(i) for i in node.inputs)
            )
        return self._changed[id(node)]

    def build(self, node: Node) -> tf.data.Dataset:
        if not self.changed(node):
            return node.dataset
        if id(node) not in self._built:
            if node in self.special:
                self._built[id(node)] = self.special[node]()
            else:
                inputs = [self.build(i) for i in node.inputs]
                self._built[id(node)] = rebuild(node, inputs, **self.overrides.get(node, {}))
        return self._built[id(node)]


def _carry_sizes(node: Node) -> dict[str, Any]:
    """Overrides for a map after the batch when elements are (micro-batch, StepSizes)."""
    func = node.params["func"]

    def carried(element: Any, sizes: StepSizes) -> Any:
        return call(func, element), sizes

    return {"func": carried}


def distribute(
    dataset: tf.data.Dataset,
    *,
    rank: int,
    size: int,
    micro_batch_size: int | None = None,
    shuffle_seed: int | None = None,
    drop_remainder: bool = False,
    split: Split = "auto",
    with_sizes: bool = False,
) -> tf.data.Dataset:
    """The micro-batches rank ``rank`` of ``size`` processes, one per serial batch.

    ``dataset`` is batched with the global batch size B, or unbatched with
    ``micro_batch_size=m`` (then batched here with B = m*size and ``drop_remainder``).
    Global batch k of size B_k is split in contiguous slices in rank order; rank r gets
    ``B_k // size + (1 if r < B_k % size else 0)`` samples (possibly 0). Every rank yields
    as many elements as the serial dataset has batches. Unseeded shuffles get the common
    seed ``shuffle_seed`` (+1 for each further unseeded shuffle; default
    DEFAULT_SHUFFLE_SEED). With ``with_sizes=True`` elements are ``(micro_batch,
    StepSizes(local, total))``.
    """
    _plan.check_rank_size(rank, size)
    root = parse(dataset)
    info = inspect_graph(root)
    if not info.batched:
        if micro_batch_size is None:
            raise DistributionError(
                "the dataset is not batched, so tnt_data cannot tell the global batch size. "
                "Batch it with the global batch size (dataset.batch(B)), or pass "
                "micro_batch_size=m to batch it here with B = m * size."
            )
        _check_micro(micro_batch_size)
        dataset = dataset.batch(int(micro_batch_size) * int(size), drop_remainder=drop_remainder)
        root = parse(dataset)
        info = inspect_graph(root)
    elif micro_batch_size is not None:
        _check_micro(micro_batch_size)
        if info.global_batch_size != micro_batch_size * size:
            raise DistributionError(
                f"the dataset is already batched with batch size {info.global_batch_size} "
                f"({info.batch_transformation}), but micro_batch_size={micro_batch_size} "
                f"with size={size} means a global batch of {micro_batch_size * size}. Pass "
                f"the dataset unbatched, batch it with {micro_batch_size * size}, or drop "
                f"micro_batch_size."
            )
    if drop_remainder and info.batched and micro_batch_size is None:
        raise DistributionError(
            "drop_remainder applies only when distribute() batches an unbatched dataset; "
            "this one is batched already: pass drop_remainder to your batch() instead."
        )
    if shuffle_seed is not None and not _is_int(shuffle_seed):
        raise DistributionError(f"shuffle_seed must be an int or None, got {shuffle_seed!r}.")

    overrides: dict[Node, dict[str, Any]] = {}
    base = DEFAULT_SHUFFLE_SEED if shuffle_seed is None else shuffle_seed
    for i, node in enumerate(_unseeded_shuffles(root)):
        overrides[node] = {"seed": GRAPH_SEED, "seed2": (int(base) + i) % 2**63}
    rebuildable = _rebuildable(root)
    for node in _all_nodes(root):
        # Rebuilt: non-deterministic transformations (ranks must see one order), and every
        # seeded shuffle that can be, so that its reshuffle state starts fresh in the
        # returned dataset instead of being shared with (and advanced by) other iterations
        # of the user's dataset.
        if node.params.get("deterministic") is False or (
            node.kind == "shuffle" and node in rebuildable
        ):
            overrides.setdefault(node, {})

    strategy, early = _strategy(root, size, split)
    special: dict[Node, Callable[[], tf.data.Dataset]] = {}
    builder = _Builder(overrides, special)
    if early is not None:
        special[early.batch] = lambda: early_batches(
            early, builder.build(early.split_input), rank, size, with_sizes
        )
        if with_sizes:
            for node in early.post:
                if node.kind == "map":
                    overrides[node] = _carry_sizes(node)
        result = builder.build(root)
    else:
        result = builder.build(root)
        if size > 1 or with_sizes:
            check_batched_spec(result.element_spec)
            result = result.map(slicer(result.element_spec, rank, size, with_sizes))
    if dataset.options().deterministic is False:
        opts = tf.data.Options()
        opts.deterministic = True
        result = result.with_options(opts)
    _check_cardinality(dataset, result, strategy)
    return result


def _is_int(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, np.integer))


def _check_micro(m: Any) -> None:
    if not _is_int(m) or m < 1:
        raise DistributionError(f"micro_batch_size must be an int >= 1, got {m!r}.")


def _check_cardinality(serial: tf.data.Dataset, local: tf.data.Dataset, strategy: Strategy) -> None:
    want = int(serial.cardinality().numpy())
    got = int(local.cardinality().numpy())
    if want != tf.data.UNKNOWN_CARDINALITY and got != want:
        raise AssertionError(  # own bug, never a user error
            f"tnt_data: distributed cardinality {got} != serial {want} ({strategy})"
        )
