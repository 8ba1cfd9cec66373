"""Turn what a user passes to fit/evaluate/predict into this rank's micro-batches.

A ``tf.data.Dataset`` batched with the GLOBAL batch size is the recommended input; NumPy
arrays and tensors with ``batch_size=`` are accepted and treated as a global batch: they
become the dataset Keras' own array adapter makes of them, so that under the same seed
the shuffled order is the one a plain Keras script sees, on 1 rank and on N.
Splitting is done by :func:`tnt_data.distribute`, so the union of the ranks' micro-batches
of step k is exactly the serial batch k. A ``keras.utils.PyDataset``, a Python generator
or a torch DataLoader is cut by the same rule in ``py_inputs`` and stays the kind of input
Keras' loop expects (a PyDataset stays a PyDataset: epochs, workers, ``on_epoch_end``).
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

import tnt_comm
import tnt_data

from . import internals as _internals
from . import py_inputs as _py_inputs
from . import runtime as _runtime
from .errors import InputError  # re-exported: tnt.InputError, data_parallel
from .log import logger

DEFAULT_BATCH_SIZE = 32


@dataclass(frozen=True)
class Sharding:
    """How to split one input: this rank's place and the user's ``tnt_*`` options."""

    rank: int
    size: int
    distribute: bool = True
    micro_batch_size: int | None = None
    shuffle_seed: int | None = None


def _python_input(x, y, sample_weight, batch_size, shuffle, sharding: Sharding, method: str,
                  with_sizes: bool, class_weight):
    """A PyDataset, generator or DataLoader: this rank's input for Keras (see py_inputs)."""
    kind = type(x).__name__
    for name, value in (("y", y), ("sample_weight", sample_weight), ("batch_size", batch_size)):
        if value is not None:
            raise InputError(
                f"tnt.Model.{method}: {name}= cannot be passed with a {kind}: its batches are "
                "global batches, (x, y) or (x, y, sample_weight), as in Keras. Drop it.")
    if sharding.micro_batch_size is not None:
        raise InputError(
            f"tnt.Model.{method}: tnt_micro_batch_size= does not apply to a {kind}, whose "
            "batches are already global batches; drop it.")
    if not sharding.distribute:
        if class_weight is not None:
            raise InputError(f"tnt.Model.{method}: class_weight with tnt_distribute_dataset=False "
                             f"is not supported for a {kind}; put the weights into its batches.")
        return x  # each rank passes its own input; Keras reads it as given
    return _py_inputs.python_input(
        x, rank=sharding.rank, size=sharding.size, with_sizes=with_sizes and sharding.size > 1,
        class_weight=class_weight,
        shuffle_seed=next_array_shuffle_seed(sharding.shuffle_seed) if shuffle and sharding.shuffle_seed is not None
        else None,
        method=method)


def _from_arrays(
    x, y, sample_weight, batch_size: int | None, shuffle, sharding: Sharding, method: str,
    class_weight=None,
) -> tf.data.Dataset:
    """The global batches plain Keras makes of arrays (same order under the same seed)."""
    if batch_size is None:
        if sharding.micro_batch_size is not None:
            batch_size = sharding.micro_batch_size * sharding.size
        else:
            batch_size = DEFAULT_BATCH_SIZE
    if not isinstance(batch_size, int | np.integer) or batch_size < 1:
        raise InputError(f"tnt.Model.{method}: batch_size must be a positive integer, got {batch_size!r}.")
    if shuffle and sharding.shuffle_seed is not None and _internals.global_seed() is None:
        # Keras draws the shuffle order from TensorFlow's global seed; with none set,
        # every rank would draw its own order and the ranks' slices of "one" global batch
        # would repeat some samples and drop others. The order comes from a seed common to
        # all ranks instead, a new one for each shuffled input built.
        with _internals.temporary_global_seed(next_array_shuffle_seed(sharding.shuffle_seed)):
            dataset = _internals.keras_array_dataset(x, y, sample_weight, int(batch_size), shuffle)
    else:
        dataset = _internals.keras_array_dataset(x, y, sample_weight, int(batch_size), shuffle)
    if class_weight is not None:
        dataset = dataset.map(class_weighted(class_weight))
    return dataset


_array_shuffles: dict[int, int] = {}


def next_array_shuffle_seed(common: int) -> int:
    """The seed of the next shuffled array input built from ``common``: every rank builds
    the same inputs in the same order, so the n-th is seeded alike everywhere, and a run
    of ``fit(..., epochs=1)`` calls does not repeat one order."""
    count = _array_shuffles.get(common, 0)
    _array_shuffles[common] = count + 1
    return int(np.random.SeedSequence([common, count]).generate_state(1)[0] % (2**31 - 1))


def class_weighted(class_weight: dict):
    """A map over (x, y[, w]) batches multiplying sample weights by ``class_weight[y]``.

    Keras' rule: one-hot/probability targets use their argmax, others their rounded value.
    """
    classes = max(int(k) for k in class_weight) + 1
    table = np.ones(classes, dtype=np.float32)
    for k, w in class_weight.items():
        table[int(k)] = float(w)
    table = tf.constant(table)

    def fn(*element):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(element)
        if isinstance(y, dict | list | tuple):
            raise InputError(
                "class_weight is only supported for models with a single output; pass "
                "per-sample weights (sample_weight=) for multi-output models."
            )
        if y.shape.rank is not None and y.shape.rank > 1 and y.shape[-1] != 1:
            labels = tf.argmax(y, axis=-1)
        else:
            labels = tf.cast(tf.round(tf.reshape(y, [-1])), tf.int64)
        weights = tf.gather(table, labels)
        if sample_weight is not None:
            weights = weights * tf.cast(tf.reshape(sample_weight, [-1]), tf.float32)
        return x, y, weights

    return fn


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
    class_weight: dict | None = None,
) -> tf.data.Dataset:
    """This rank's dataset of micro-batches for ``method`` ('fit', 'evaluate', 'predict').

    ``with_sizes`` adds each step's local and global sample counts to the elements
    (``(batch, tnt_data.StepSizes)``), so a training step knows ``b_r / B`` before backprop.
    """
    if _py_inputs.is_python_input(x):
        return _python_input(x, y, sample_weight, batch_size, shuffle, sharding, method, with_sizes,
                             class_weight)
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
        dataset = x if class_weight is None else x.map(class_weighted(class_weight))
    else:
        dataset = _from_arrays(x, y, sample_weight, batch_size, shuffle, sharding, method, class_weight)
        if not sharding.distribute or sharding.size == 1:
            return dataset
        return tnt_data.split_batches(dataset, rank=sharding.rank, size=sharding.size,
                                      with_sizes=with_sizes)
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


#: Iterators Keras 3's EpochIterator creates per epoch when steps_per_epoch is None.
_KERAS_ITERATORS_PER_EPOCH = 2


def at_epoch(dataset: tf.data.Dataset, user_input, epoch: int, steps_per_epoch) -> tf.data.Dataset:
    """``dataset`` with its reshuffling state where a run from epoch 0 has it at ``epoch``.

    A shuffle with ``reshuffle_each_iteration`` draws a new order for each new iterator,
    and Keras' epoch loop creates ``_KERAS_ITERATORS_PER_EPOCH`` iterators per epoch of a
    dataset of known length (one when the epoch starts, one after its last batch).
    Creating (and dropping) as many iterators as the first ``epoch`` epochs would advances
    the order without reading data. This needs a dataset whose state starts fresh: tnt
    builds one per fit (distributed or from arrays); one passed through unchanged (one
    rank) is rebuilt. tests/test_resume.py checks the count against an uninterrupted run.
    """
    if not isinstance(dataset, tf.data.Dataset) or _py_inputs.is_python_input(user_input):
        return dataset  # Keras' own loop starts these at the first batch, as serial Keras does
    if steps_per_epoch:
        logger.warning(
            "fit(initial_epoch=%d) with steps_per_epoch: the data position of the interrupted "
            "run is not restored (Keras then continues one iterator across epochs); the "
            "resumed epochs start from a fresh iterator.", epoch)
        return dataset
    if dataset is user_input:
        try:
            dataset = tnt_data.distribute(dataset, rank=0, size=1)
        except tnt_data.DistributionError:
            logger.warning(
                "fit(initial_epoch=%d): this dataset cannot be rebuilt, so its shuffle order "
                "from epoch %d on may differ from an uninterrupted run.", epoch, epoch)
            return dataset
    if int(dataset.cardinality()) < 0:
        logger.warning(
            "fit(initial_epoch=%d): the dataset's length is unknown, so its shuffle order "
            "from epoch %d on may differ from an uninterrupted run.", epoch, epoch)
        return dataset
    for _ in range(epoch * _KERAS_ITERATORS_PER_EPOCH):
        iter(dataset)
    return dataset


def check_same_length(dataset: tf.data.Dataset, what: str, method: str) -> None:
    """Every rank must run as many steps as the others, or one waits in a step forever.

    tnt's own split guarantees it; datasets the ranks build themselves
    (``tnt_distribute_dataset=False``) may differ. One small allgather per call. A length
    TensorFlow cannot tell (e.g. after ``filter``) is not checked here; a difference then
    shows as a stall after TNT_COMM_TIMEOUT.
    """
    if _runtime.get_size() == 1:
        return
    if isinstance(dataset, keras.utils.PyDataset):
        n = dataset.num_batches
        length = tf.data.INFINITE_CARDINALITY if n is None else int(n)
    else:
        length = int(dataset.cardinality())
    lengths = tnt_comm.allgather_object(length)
    if len(set(lengths)) == 1 or tf.data.UNKNOWN_CARDINALITY in lengths:
        return

    def show(n: int) -> str:
        return "infinite" if n == tf.data.INFINITE_CARDINALITY else str(n)

    per_rank = ", ".join(f"rank {r}: {show(n)}" for r, n in enumerate(lengths))
    raise InputError(
        f"tnt.Model.{method}: the ranks' {what} datasets have different numbers of batches "
        f"({per_rank}), so some rank would wait in a step the others never run. With "
        "tnt_distribute_dataset=False every rank must pass the same number of batches (e.g. "
        "dataset.shard(num_shards, index) of a dataset whose length the number of ranks "
        "divides, or .take(n) with the same n everywhere); or pass one dataset and let tnt "
        "split it (tnt_distribute_dataset=True)."
    )


def unpack_validation(validation_data, validation_batch_size, batch_size):
    """``fit(validation_data=...)`` as (x, y, sample_weight, batch size): a dataset is
    already batched (batch size None); a tuple is batched by validation_batch_size,
    else by the training batch size, as Keras does."""
    if isinstance(validation_data, tf.data.Dataset) or _py_inputs.is_python_input(validation_data):
        return validation_data, None, None, None
    vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
    return vx, vy, vsw, validation_batch_size or batch_size


def split_arrays(arrays, validation_split: float):
    """Keras' rule: the last ``validation_split`` fraction of the samples validates."""
    if not 0 < validation_split < 1:
        raise InputError(f"validation_split must be in (0, 1), got {validation_split}.")
    first = next(a for a in tf.nest.flatten(arrays) if a is not None)
    n = int(first.shape[0])
    cut = int(n * (1.0 - validation_split))

    def take(a, sl):
        return None if a is None else tf.nest.map_structure(lambda t: t[sl], a)

    train = tuple(take(a, slice(0, cut)) for a in arrays)
    val = tuple(take(a, slice(cut, n)) for a in arrays)
    return train, val


def fit_datasets(x, y, sample_weight, *, sharding: Sharding, batch_size, shuffle, class_weight,
                 validation_split: float, validation_data, validation_batch_size):
    """fit's training dataset (elements carry their step sizes) and validation dataset (or
    None) for a replica's slice of every global batch (pipelines, tensor groups)."""
    if validation_split:
        if isinstance(x, tf.data.Dataset) or _py_inputs.is_python_input(x):
            raise InputError("tnt.Model.fit: validation_split needs arrays; pass validation_data= for datasets.")
        (x, y, sample_weight), validation_data = split_arrays((x, y, sample_weight), validation_split)
    train = rank_dataset(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle, method="fit",
                         sharding=sharding, with_sizes=True, class_weight=class_weight)
    if validation_data is None:
        return train, None
    vx, vy, vsw, vbatch = unpack_validation(validation_data, validation_batch_size, batch_size)
    return train, rank_dataset(vx, vy, vsw, batch_size=vbatch, shuffle=False, method="fit(validation_data)",
                               sharding=sharding)


#: Mixed with TensorFlow's global seed, so the common shuffle seed is not the user's seed.
_SEED_SALT = 0x746E74


def common_seed() -> int:
    """A shuffle seed equal on all ranks, for unseeded dataset shuffles.

    Derived from TensorFlow's global seed when one is set (``keras.utils.set_random_seed``
    or ``tf.random.set_seed``), so that every run of the script, a resumed one too,
    shuffles alike; otherwise drawn at random. Rank 0's choice is used everywhere.
    """
    seed = _internals.global_seed()
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (2**31 - 1))
    else:
        seed = int(np.random.SeedSequence([seed, _SEED_SALT]).generate_state(1)[0] % (2**31 - 1))
    if _runtime.get_size() > 1:
        seed = tnt_comm.broadcast_object(seed, _runtime.MASTER_RANK)
    return int(seed)
