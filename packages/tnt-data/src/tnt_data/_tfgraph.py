"""The only module that reads tf.data internals: pipeline -> Node graph -> rebuilt pipeline.

tf.data keeps no public description of a pipeline, so we read what each transformation
stores on its Python object (`_input_dataset`, `_batch_size`, `_map_func._func`, ...)
as TensorFlow 2.16-2.21 does, and rebuild transformations through the public
`tf.data.Dataset` methods. If a TensorFlow release renames these, every access fails
here with a DistributionError naming the attribute and TensorFlow version, never an
AttributeError from deep inside tnt_data.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from tnt_data.errors import DistributionError

TESTED_TF = "2.16-2.21"
_FIX = "pass tnt_distribute_dataset=False and shard the dataset by hand"


def _tf_class(module: str, name: str) -> type | None:
    try:
        mod = importlib.import_module(f"tensorflow.python.data.{module}")
    except ImportError:
        return None
    return getattr(mod, name, None)


# Transformation classes of TF 2.21 (tensorflow/python/data/ops/*_op.py), by our kind name.
_CLASSES: dict[str, list[tuple[str, str]]] = {
    "map": [("ops.map_op", "_MapDataset"), ("ops.map_op", "_ParallelMapDataset")],
    "filter": [("ops.filter_op", "_FilterDataset")],
    "flat_map": [("ops.flat_map_op", "_FlatMapDataset")],
    "interleave": [
        ("ops.interleave_op", "_InterleaveDataset"),
        ("ops.interleave_op", "_ParallelInterleaveDataset"),
    ],
    "batch": [("ops.batch_op", "_BatchDataset"), ("ops.batch_op", "_ParallelBatchDataset")],
    "padded_batch": [("ops.padded_batch_op", "_PaddedBatchDataset")],
    "shuffle": [("ops.shuffle_op", "_ShuffleDataset")],
    "cache": [("ops.cache_op", "CacheDataset")],
    "repeat": [("ops.repeat_op", "_RepeatDataset")],
    "take": [("ops.take_op", "_TakeDataset")],
    "skip": [("ops.skip_op", "_SkipDataset")],
    "prefetch": [("ops.prefetch_op", "_PrefetchDataset")],
    "zip": [("ops.zip_op", "_ZipDataset")],
    "concatenate": [("ops.concatenate_op", "_ConcatenateDataset")],
    "options": [("ops.dataset_ops", "_OptionsDataset")],
    "assert_cardinality": [("experimental.ops.cardinality", "_AssertCardinalityDataset")],
    "unbatch": [("ops.unbatch_op", "_UnbatchDataset")],
}
_KIND_OF: list[tuple[type, str]] = [
    (cls, kind)
    for kind, names in _CLASSES.items()
    for cls in (_tf_class(m, n) for m, n in names)
    if cls is not None
]


@dataclass(eq=False)
class Node:
    """One transformation of a pipeline: what it is, its inputs and its arguments."""

    kind: str  # a key of _CLASSES, "source" (no inputs) or "opaque" (unknown, has inputs)
    dataset: tf.data.Dataset
    inputs: list[Node] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Name used in error messages: `map`, `shuffle`, or the TF class for unknown ops."""
        if self.kind in ("source", "opaque"):
            return type(self.dataset).__name__
        return self.kind


def _attr(ds: tf.data.Dataset, name: str) -> Any:
    try:
        return getattr(ds, name)
    except AttributeError:
        raise DistributionError(
            f"tnt_data cannot read the {type(ds).__name__} transformation: attribute "
            f"{name!r} is missing in TensorFlow {tf.__version__} (tnt_data was tested with "
            f"TensorFlow {TESTED_TF}). Upgrade tnt_data, or {_FIX}."
        ) from None


def _value(t: Any) -> Any:
    """A Python value of a constant tensor stored by a transformation."""
    if isinstance(t, tf.Tensor):
        v = tf.get_static_value(t)
        if v is None:
            raise DistributionError(
                f"tnt_data needs the arguments of every transformation as constants, but got "
                f"a symbolic tensor {t!r} (a pipeline built inside tf.function?). Build the "
                f"dataset eagerly, or {_FIX}."
            )
        return v.item() if hasattr(v, "item") and v.ndim == 0 else v
    return t


def _deterministic(ds: tf.data.Dataset) -> bool | None:
    """The ``deterministic`` argument of a parallel transformation (None: from options).

    TF does not keep it for parallel interleave (only in the kernel's attributes): that
    counts as False, so the interleave is rebuilt deterministic.
    """
    if getattr(ds, "_num_parallel_calls", None) is None:
        return None
    flag = getattr(ds, "_deterministic", "false")
    return {"default": None, "true": True, "false": False}[flag]


def _func(wrapper: Any, ds: tf.data.Dataset) -> Callable:
    fn = getattr(wrapper, "_func", None)
    if fn is None:
        _attr(wrapper, "_func")  # raises the version error naming the attribute
    return fn


def _traced(wrapper: Any, ds: tf.data.Dataset) -> Callable:
    """A callable that runs the function ``wrapper`` already traced, on a structured element.

    Rebuilding a map with it costs no re-trace (no autograph, no user Python run again,
    captured variables and tables kept): the new map calls the same graph function.
    Falls back to the user's Python function if TF keeps the trace differently.
    """
    try:
        from tensorflow.python.data.util import structure

        fn = wrapper.function
        in_spec, out_spec = wrapper._input_structure, wrapper.output_structure
    except (AttributeError, ImportError):
        return _func(wrapper, ds)

    @tf.autograph.experimental.do_not_convert
    def run(*args: Any) -> Any:
        element = args if type(in_spec) is tuple else args[0]
        flat = fn(*structure.to_tensor_list(in_spec, element))
        return structure.from_compatible_tensor_list(out_spec, flat)

    return run


def _params(kind: str, ds: tf.data.Dataset) -> dict[str, Any]:
    a = lambda name: _attr(ds, name)  # noqa: E731
    if kind == "map":
        npc = getattr(ds, "_num_parallel_calls", None)
        return {
            "func": _traced(a("_map_func"), ds),
            "num_parallel_calls": None if npc is None else _value(npc),
            "deterministic": _deterministic(ds),
        }
    if kind == "filter":
        return {"func": _traced(a("_predicate"), ds)}
    if kind == "flat_map":
        return {"func": _func(a("_map_func"), ds)}
    if kind == "interleave":
        npc = getattr(ds, "_num_parallel_calls", None)
        return {
            "func": _func(a("_map_func"), ds),
            "cycle_length": _value(a("_cycle_length")),
            "block_length": _value(a("_block_length")),
            "num_parallel_calls": None if npc is None else _value(npc),
            "deterministic": _deterministic(ds),
        }
    if kind == "batch":
        npc = getattr(ds, "_num_parallel_calls", None)
        return {
            "batch_size": _value(a("_batch_size")),
            "drop_remainder": bool(_value(a("_drop_remainder"))),
            "num_parallel_calls": None if npc is None else _value(npc),
            "deterministic": _deterministic(ds),
        }
    if kind == "padded_batch":
        return {
            "batch_size": _value(a("_batch_size")),
            "drop_remainder": bool(_value(a("_drop_remainder"))),
            "padded_shapes": a("_padded_shapes"),
            "padding_values": a("_padding_values"),
        }
    if kind == "shuffle":
        return {
            "buffer_size": _value(a("_buffer_size")),
            "seed": int(_value(a("_seed"))),
            "seed2": int(_value(a("_seed2"))),
            "reshuffle_each_iteration": bool(a("_reshuffle_each_iteration")),
        }
    if kind == "cache":
        name = _value(a("_filename"))
        return {"filename": name.decode() if isinstance(name, bytes) else str(name)}
    if kind in ("repeat", "take", "skip"):
        return {"count": _value(a("_count"))}
    if kind == "prefetch":
        return {"buffer_size": _value(a("_buffer_size"))}
    if kind == "zip":
        return {"structure": a("_datasets")}
    if kind == "options":
        return {"options": a("_options_attr")}
    if kind == "assert_cardinality":
        return {"count": _value(a("_expected_cardinality"))}
    return {}


def _kind(ds: tf.data.Dataset) -> str:
    for cls, kind in _KIND_OF:
        if type(ds) is cls or isinstance(ds, cls):
            return kind
    return "source" if not _inputs(ds) else "opaque"


def _inputs(ds: tf.data.Dataset) -> list[tf.data.Dataset]:
    try:
        return list(ds._inputs())
    except (AttributeError, NotImplementedError):
        raise DistributionError(
            f"tnt_data cannot walk the input pipeline: {type(ds).__name__}._inputs() is "
            f"missing in TensorFlow {tf.__version__} (tested with {TESTED_TF}). "
            f"Upgrade tnt_data, or {_FIX}."
        ) from None


def parse(dataset: tf.data.Dataset) -> Node:
    """Describe a pipeline as a graph of Nodes (shared sub-pipelines become shared Nodes)."""
    if not isinstance(dataset, tf.data.Dataset):
        raise DistributionError(
            f"expected a tf.data.Dataset, got {type(dataset).__name__}. Wrap arrays with "
            f"tf.data.Dataset.from_tensor_slices(...) first."
        )
    seen: dict[int, Node] = {}

    def visit(ds: tf.data.Dataset) -> Node:
        key = id(ds)
        if key not in seen:
            kind = _kind(ds)
            seen[key] = Node(kind, ds, [visit(i) for i in _inputs(ds)], _params(kind, ds))
        return seen[key]

    return visit(dataset)


class _ExplicitSeedShuffle(_tf_class("ops.shuffle_op", "_ShuffleDataset") or tf.data.Dataset):
    """shuffle() with both seeds given, as TF stores them: the public method derives seed
    pairs from the global seed, and a rebuilt user shuffle must keep its exact pair."""

    def __init__(self, input_dataset, buffer_size, seed, seed2, reshuffle_each_iteration):
        from tensorflow.python.data.ops import dataset_ops
        from tensorflow.python.ops import gen_dataset_ops

        self._input_dataset = input_dataset
        self._buffer_size = tf.constant(buffer_size, tf.int64, name="buffer_size")
        self._seed = tf.constant(seed, tf.int64, name="seed")
        self._seed2 = tf.constant(seed2, tf.int64, name="seed2")
        self._reshuffle_each_iteration = reshuffle_each_iteration
        self._name = None
        variant = gen_dataset_ops.shuffle_dataset_v3(
            input_dataset._variant_tensor,
            buffer_size=self._buffer_size,
            seed=self._seed,
            seed2=self._seed2,
            seed_generator=gen_dataset_ops.dummy_seed_generator(),
            reshuffle_each_iteration=reshuffle_each_iteration,
            **self._common_args,
        )
        dataset_ops.UnaryUnchangedStructureDataset.__init__(self, input_dataset, variant)


def shuffle(
    dataset: tf.data.Dataset, buffer_size: int, seed: int, seed2: int, reshuffle: bool
) -> tf.data.Dataset:
    """dataset.shuffle with an exact (seed, seed2) pair."""
    return _ExplicitSeedShuffle(dataset, buffer_size, seed, seed2, reshuffle)


def rebuild(
    node: Node, inputs: Sequence[tf.data.Dataset], **overrides: Any
) -> tf.data.Dataset:
    """Apply ``node``'s transformation again, on new ``inputs``, through the public API.

    Parallel maps, interleaves and batches are rebuilt deterministic: every rank must see
    the elements in the same order.
    """
    p = {**node.params, **overrides}
    k = node.kind
    if k in ("source", "opaque"):
        raise DistributionError(
            f"tnt_data cannot rebuild the {node.label} transformation, but must: something "
            f"below it changes (an unseeded shuffle gets the common seed, or a "
            f"deterministic=False transformation is made deterministic). Give that shuffle "
            f"a seed / make it deterministic yourself, or {_FIX}."
        )
    if k == "zip":
        return tf.data.Dataset.zip(tf.nest.pack_sequence_as(p["structure"], list(inputs)))
    if k == "concatenate":
        return inputs[0].concatenate(inputs[1])
    (x,) = inputs
    if k == "map":
        if p["num_parallel_calls"] is None:
            return x.map(p["func"])
        return x.map(p["func"], num_parallel_calls=p["num_parallel_calls"], deterministic=True)
    if k == "filter":
        return x.filter(p["func"])
    if k == "flat_map":
        return x.flat_map(p["func"])
    if k == "interleave":
        npc = p["num_parallel_calls"]
        return x.interleave(
            p["func"],
            cycle_length=p["cycle_length"],
            block_length=p["block_length"],
            num_parallel_calls=npc,
            deterministic=None if npc is None else True,
        )
    if k == "batch":
        npc = p["num_parallel_calls"]
        return x.batch(
            p["batch_size"],
            drop_remainder=p["drop_remainder"],
            num_parallel_calls=npc,
            deterministic=None if npc is None else True,
        )
    if k == "padded_batch":
        return x.padded_batch(
            p["batch_size"],
            padded_shapes=p["padded_shapes"],
            padding_values=p["padding_values"],
            drop_remainder=p["drop_remainder"],
        )
    if k == "shuffle":
        return shuffle(x, p["buffer_size"], p["seed"], p["seed2"], p["reshuffle_each_iteration"])
    if k == "cache":
        return x.cache(p["filename"])
    if k == "repeat":
        return x.repeat(p["count"])
    if k == "take":
        return x.take(p["count"])
    if k == "skip":
        return x.skip(p["count"])
    if k == "prefetch":
        return x.prefetch(p["buffer_size"])
    if k == "options":
        return x.with_options(p["options"])
    if k == "unbatch":
        return x.unbatch()
    if k == "assert_cardinality":
        return x.apply(tf.data.experimental.assert_cardinality(p["count"]))
    raise AssertionError(f"unhandled kind {k}")  # own bug: every kind is listed above
