"""Turn what a user passes to fit/evaluate/predict into this rank's micro-batches.

A ``tf.data.Dataset`` batched with the GLOBAL batch size is the recommended input; NumPy
arrays and tensors with ``batch_size=`` are accepted and treated as a global batch (they
become a dataset, shuffled with a seed common to all ranks when ``shuffle=True``).
Splitting is done by :func:`tnt_data.distribute`, so the union of the ranks' micro-batches
of step k is exactly the serial batch k.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

import tnt_data

DEFAULT_BATCH_SIZE = 32


class InputError(ValueError):
    """The input given to fit/evaluate/predict cannot be distributed as given."""


@dataclass(frozen=True)
class Sharding:
    """How to split one input: this rank's place and the user's ``tnt_*`` options."""

    rank: int
    size: int
    distribute: bool = True
    micro_batch_size: int | None = None
    shuffle_seed: int | None = None


def _reject_unsplittable(x, method: str) -> None:
    if inspect.isgenerator(x) or isinstance(x, keras.utils.PyDataset):
        raise InputError(
            f"tnt.Model.{method}: Python generators and keras.utils.PyDataset cannot be split "
            "sample by sample across ranks. Wrap the generator as "
            "tf.data.Dataset.from_generator(...) batched with the global batch size, or "
            "pass NumPy arrays with batch_size=."
        )


def _from_arrays(
    x, y, sample_weight, batch_size: int | None, shuffle: bool, sharding: Sharding, method: str
) -> tf.data.Dataset:
    if batch_size is None:
        if sharding.micro_batch_size is not None:
            batch_size = sharding.micro_batch_size * sharding.size
        else:
            batch_size = DEFAULT_BATCH_SIZE
    if not isinstance(batch_size, int | np.integer) or batch_size < 1:
        raise InputError(f"tnt.Model.{method}: batch_size must be a positive integer, got {batch_size!r}.")
    parts = tuple(p for p in (x, y, sample_weight) if p is not None)
    element = parts[0] if len(parts) == 1 else parts
    dataset = tf.data.Dataset.from_tensor_slices(element)
    if shuffle:
        length = int(dataset.cardinality())
        dataset = dataset.shuffle(max(length, 1), seed=sharding.shuffle_seed, reshuffle_each_iteration=True)
    return dataset.batch(int(batch_size))


def global_batch_size(dataset: tf.data.Dataset, sharding: Sharding) -> int | None:
    """The global batch size B of a user dataset, when it can be told (for warnings)."""
    if sharding.micro_batch_size is not None:
        return sharding.micro_batch_size * sharding.size
    try:
        return tnt_data.inspect(dataset).global_batch_size
    except tnt_data.DistributionError:
        return None


def _known_unbatched(dataset: tf.data.Dataset) -> bool:
    try:
        return not tnt_data.inspect(dataset).batched
    except tnt_data.DistributionError:  # a pipeline tnt_data cannot read runs as given
        return False


def rank_dataset(
    x,
    y=None,
    sample_weight=None,
    *,
    batch_size: int | None,
    shuffle: bool,
    sharding: Sharding,
    method: str,
    with_sizes: bool = False,
) -> tf.data.Dataset:
    """This rank's dataset of micro-batches for ``method`` ('fit', 'evaluate', 'predict').

    ``with_sizes`` adds each step's local and global sample counts to the elements
    (``(batch, tnt_data.StepSizes)``), so a training step knows ``b_r / B`` before backprop.
    """
    _reject_unsplittable(x, method)
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise InputError(
                f"tnt.Model.{method}: y/sample_weight cannot be passed with a tf.data.Dataset; "
                "put them in the dataset's elements as (x, y) or (x, y, sample_weight)."
            )
        if batch_size is not None:
            raise InputError(
                f"tnt.Model.{method}: batch_size={batch_size} was given together with a "
                "tf.data.Dataset (double batching). Batch the dataset with the global batch "
                "size (dataset.batch(B)) and drop batch_size=, or pass an unbatched dataset "
                "with tnt_micro_batch_size=."
            )
        dataset = x
    else:
        dataset = _from_arrays(x, y, sample_weight, batch_size, shuffle, sharding, method)
    try:
        if not sharding.distribute:
            return dataset
        if sharding.size == 1 and sharding.micro_batch_size is None:
            # One rank: the pipeline runs as given; only refuse what N ranks would refuse,
            # so a script behaves the same under `python` and under the launcher.
            if _known_unbatched(dataset):
                raise tnt_data.DistributionError(
                    "the dataset is not batched, so tnt_data cannot tell the global batch "
                    "size. Batch it with the global batch size (dataset.batch(B)), or pass "
                    "micro_batch_size=m to batch it here with B = m * size."
                )
            return dataset
        return tnt_data.distribute(
            dataset,
            rank=sharding.rank,
            size=sharding.size,
            micro_batch_size=sharding.micro_batch_size,
            shuffle_seed=sharding.shuffle_seed,
            with_sizes=with_sizes and sharding.size > 1,
        )
    except tnt_data.DistributionError as err:
        # tnt_data speaks of its own argument; the user passed tnt_micro_batch_size.
        message = str(err).replace(" micro_batch_size=", " tnt_micro_batch_size=")
        message = message.replace("drop micro_batch_size", "drop tnt_micro_batch_size")
        raise InputError(f"tnt.Model.{method}: {message}") from err
