"""Python inputs on N ranks: ``keras.utils.PyDataset``, generators, torch DataLoaders.

Each is handed to Keras as the same kind of input, yielding this rank's micro-batch of
every global batch by tnt_data's rule (contiguous slices in rank order, sizes differ by at
most one, none dropped), so Keras' own loop (epochs, ``on_epoch_end``, ``workers``,
``steps_per_epoch``) runs as in a serial script:

- a PyDataset becomes a PyDataset (:class:`RankPyDataset`): batch i is ``dataset[i]``,
  cut; with ``num_rows(i)`` and ``get_rows(i, start, stop)`` a rank loads only its rows;
- a generator or a torch DataLoader (duck-typed: no torch import) is iterated whole on
  every rank, which keeps its rows; a fingerprint of each global batch (shapes, dtypes, a
  sample of values) is compared across ranks before the batch is used, so ranks that
  yield different data stop with :class:`InputError` naming the batch, on every rank.
  The comparison runs inside the step's read of the batch: the dataset has no prefetch,
  so every rank reads (and compares) exactly the batches its steps consume.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import re
import zlib
from collections.abc import Callable, Iterable, Iterator

import keras
import numpy as np
import tensorflow as tf

import tnt_comm
import tnt_data

from . import runtime as _runtime
from .errors import InputError

#: Batches read to tell the element structure, as Keras reads them (data_adapter_utils).
_SPEC_BATCHES = 2
#: Values sampled from each array of a batch for its fingerprint.
_SAMPLES = 64
#: The fingerprint of "no more batches".
_END = -1


def is_torch_loader(x) -> bool:
    """A ``torch.utils.data.DataLoader`` (or subclass), told without importing torch."""
    return any(c.__name__ == "DataLoader" and c.__module__.startswith("torch.utils.data")
               for c in type(x).__mro__)


def is_python_input(x) -> bool:
    """Inputs this module splits (the rest are arrays or tf.data datasets)."""
    return isinstance(x, keras.utils.PyDataset) or inspect.isgenerator(x) or is_torch_loader(x)


# -- batches as NumPy structures ---------------------------------------------------------------
def _to_numpy(leaf):
    if leaf is None or isinstance(leaf, np.ndarray):
        return leaf
    if hasattr(leaf, "detach") and hasattr(leaf, "cpu"):  # a torch tensor, duck-typed
        return leaf.detach().cpu().numpy()
    if isinstance(leaf, tf.SparseTensor | tf.RaggedTensor):
        return leaf
    return np.asarray(leaf)


def standardize(batch, method: str, what: str):
    """Keras' rule: a tuple (x,), (x, y) or (x, y, sample_weight), or a dict; leaves NumPy."""
    if isinstance(batch, np.ndarray) or hasattr(batch, "shape"):
        batch = (batch,)
    elif isinstance(batch, list):
        batch = tuple(batch)
    if isinstance(batch, dict):
        return keras.tree.map_structure(_to_numpy, batch)
    if not isinstance(batch, tuple) or len(batch) not in (1, 2, 3):
        raise InputError(
            f"tnt.Model.{method}: the {what} gave a {type(batch).__name__}; each batch must be "
            "a tuple (x,), (x, y) or (x, y, sample_weight), or a dict, as Keras requires.")
    return tuple(keras.tree.map_structure(_to_numpy, part) for part in batch)


def rows(batch) -> int:
    """The batch size of a batch: the first dimension of its first array."""
    first = next((leaf for leaf in keras.tree.flatten(batch) if leaf is not None), None)
    if first is None or len(getattr(first, "shape", ())) == 0:
        raise InputError("a batch has no array with a batch dimension to split.")
    return int(first.shape[0])


def cut(batch, rank: int, size: int, with_sizes: bool, vector: bool = False):
    """``rank``'s rows of ``batch`` (tnt_data's rule); with ``StepSizes`` when asked."""
    n = rows(batch)
    part = tnt_data.micro_batch_slice(n, rank, size)
    local = keras.tree.map_structure(lambda a: None if a is None else a[part], batch)
    return sized(local, part.stop - part.start, n, vector) if with_sizes else local


def sized(local, count: int, total: int, vector: bool):
    """``(local, StepSizes)``; ``vector``: the sizes as arrays of one element, for Keras'
    PyDataset loop, which wants a dimension on every array (step_parts drops it)."""
    def value(v: int):
        return np.array([v], np.int64) if vector else np.int64(v)

    return local, tnt_data.StepSizes(value(count), value(total))


def with_class_weight(batch, class_weight: dict | None, method: str):
    """(x, y) -> (x, y, w) by Keras' class_weight rule (argmax of one-hot, else rounded)."""
    if class_weight is None:
        return batch
    if isinstance(batch, dict) or len(batch) != 2:
        raise InputError(
            f"tnt.Model.{method}: class_weight needs batches (x, y) with a single output and "
            "no sample weights (as in Keras); put the weights into the batches instead.")
    x, y = batch
    y = np.asarray(y)
    labels = np.argmax(y, axis=-1) if y.ndim > 1 and y.shape[-1] > 1 else np.round(y.reshape(-1)).astype(np.int64)
    weights = np.array([class_weight.get(int(k), 1.0) for k in labels.reshape(-1)], dtype=np.float32)
    return x, y, weights


def element_spec(batches: list):
    """The tf.TypeSpec structure common to ``batches``: unknown where shapes differ, and
    always in the batch dimension (ranks' micro-batches differ in size)."""
    def spec(*leaves):
        first = leaves[0]
        if isinstance(first, tf.SparseTensor | tf.RaggedTensor):
            return tf.type_spec_from_value(first)
        shape = [None if i == 0 or len({np.shape(a)[i] for a in leaves}) > 1 else d
                 for i, d in enumerate(np.shape(first))]
        return tf.TensorSpec(shape, tf.as_dtype(np.asarray(first).dtype))

    return tf.nest.map_structure(spec, *batches)


# -- PyDataset ---------------------------------------------------------------------------------
class RankPyDataset(keras.utils.PyDataset):
    """This rank's micro-batches of a user's PyDataset, as a PyDataset for Keras' loop.

    ``self[i]`` is this rank's rows of ``dataset[i]`` (of ``dataset[order[i]]`` when fit
    shuffles, with an order drawn per epoch from a seed common to all ranks). Keras calls
    ``on_epoch_begin`` / ``on_epoch_end`` here and they reach the user's dataset, and the
    user's ``workers`` / ``use_multiprocessing`` / ``max_queue_size`` apply to this rank.
    With ``num_rows(i)`` and ``get_rows(i, start, stop)`` on the user's dataset, only this
    rank's rows are loaded.
    """

    def __init__(self, dataset: keras.utils.PyDataset, *, rank: int, size: int, with_sizes: bool,
                 class_weight: dict | None, shuffle_seed: int | None, method: str) -> None:
        super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self.dataset, self.rank, self.size = dataset, rank, size
        self.with_sizes, self.class_weight, self.method = with_sizes, class_weight, method
        self.by_rows = callable(getattr(dataset, "get_rows", None))
        if self.by_rows and not callable(getattr(dataset, "num_rows", None)):
            raise InputError(
                f"tnt.Model.{method}: {type(dataset).__name__} defines get_rows(index, start, stop) "
                "but not num_rows(index), the number of samples of batch `index`; a rank needs it "
                "to know its rows before loading them. Define num_rows too.")
        if self.by_rows and class_weight is not None:
            raise InputError(
                f"tnt.Model.{method}: class_weight with a PyDataset that loads rows "
                "(get_rows) is not supported; put the weights into its batches.")
        self._seed, self._epoch = shuffle_seed, 0
        self._order: list[int] | None = None
        self._draw_order()
        self._spec = None
        self._peeked: dict[int, object] = {}  # batches read for element_spec, until Keras reads them

    def _draw_order(self) -> None:
        n = self.dataset.num_batches
        if self._seed is None or n is None:
            self._order = None
            return
        rng = np.random.default_rng(np.random.SeedSequence([self._seed, self._epoch]))
        self._order = [int(i) for i in rng.permutation(n)]

    @property
    def num_batches(self):
        return self.dataset.num_batches

    def __len__(self) -> int:
        n = self.dataset.num_batches
        if n is None:
            raise TypeError("an infinite PyDataset has no length")
        return n

    def on_epoch_begin(self) -> None:
        self._peeked.clear()
        self.dataset.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self._peeked.clear()
        self.dataset.on_epoch_end()
        self._epoch += 1
        self._draw_order()  # here, not at epoch begin: Keras starts the workers before that

    def __getitem__(self, index: int):
        peeked = self._peeked.pop(int(index), None)
        if peeked is not None:
            return peeked
        return self._load(int(index))

    def _load(self, index: int):
        i = index if self._order is None else self._order[index]
        if not self.by_rows:
            batch = with_class_weight(standardize(self.dataset[i], self.method, "PyDataset"),
                                      self.class_weight, self.method)
            return cut(batch, self.rank, self.size, self.with_sizes, vector=True)
        n = int(self.dataset.num_rows(i))
        part = tnt_data.micro_batch_slice(n, self.rank, self.size)
        local = standardize(self.dataset.get_rows(i, part.start, part.stop), self.method, "PyDataset")
        got = rows(local)
        if got != part.stop - part.start:
            raise InputError(
                f"tnt.Model.{self.method}: {type(self.dataset).__name__}.get_rows({i}, {part.start}, "
                f"{part.stop}) returned {got} rows, not {part.stop - part.start}; it must return "
                "rows start..stop-1 of batch i (num_rows(i) of them in all).")
        return sized(local, got, n, vector=True) if self.with_sizes else local

    @property
    def element_spec(self):
        """The structure of this rank's batches (read from the first ones, as Keras does)."""
        if self._spec is None:
            n = self.num_batches
            count = _SPEC_BATCHES if n is None else min(_SPEC_BATCHES, n)
            if count == 0:
                raise InputError(f"tnt.Model.{self.method}: the PyDataset has no batches.")
            # Keras reads the same first batches next for its own structure: they are
            # served from here once, so no rank loads them twice more than serial Keras.
            self._peeked = {i: self._load(i) for i in range(count)}
            self._spec = element_spec(list(self._peeked.values()))
        return self._spec


# -- generators and DataLoaders ----------------------------------------------------------------
_check_comm: tnt_comm.Communicator | None = None


def _comm() -> tnt_comm.Communicator:
    """One duplicate of the world for input checks, so they never mix with other traffic.
    Created at the first Python input, which every rank passes at the same point."""
    global _check_comm
    if _check_comm is None:
        _check_comm = tnt_comm.world().dup()
    return _check_comm


def fingerprint(batch) -> int:
    """A cheap hash of a global batch: structure, shapes, dtypes, <= 64 values per array."""
    crc = zlib.crc32(repr(keras.tree.map_structure(lambda a: None, batch)).encode())
    for leaf in keras.tree.flatten(batch):
        if leaf is None:
            continue
        a = np.asarray(leaf)
        crc = zlib.crc32(f"{a.shape}{a.dtype}".encode(), crc)
        flat = a.reshape(-1)
        sample = flat[:: max(1, flat.size // _SAMPLES)][:_SAMPLES]
        data = repr(sample.tolist()).encode() if a.dtype.kind in "OUSV" else np.ascontiguousarray(sample).tobytes()
        crc = zlib.crc32(data, crc)
    return crc


class SameOnRanks:
    """Compares each global batch's fingerprint across all ranks before it is used."""

    def __init__(self, method: str, what: str) -> None:
        self.method, self.what, self.batch = method, what, 0
        self.comm = _comm() if _runtime.get_size() > 1 else None

    def check(self, batch) -> None:
        """``batch`` None: this rank's input has ended."""
        if self.comm is not None:
            mine = _END if batch is None else fingerprint(batch)
            everyone = [int(v) for v in self.comm.allgather(np.array([mine], np.int64)).reshape(-1)]
            if len(set(everyone)) > 1:
                raise InputError(self._message(everyone))
        self.batch += 1

    def _message(self, everyone: list[int]) -> str:
        ended = [r for r, v in enumerate(everyone) if v == _END]
        if ended:
            detail = (f"the {self.what} of rank(s) {ended} ended there while rank(s) "
                      f"{[r for r, v in enumerate(everyone) if v != _END]} yielded another batch")
        else:
            groups: dict[int, list[int]] = {}
            for r, v in enumerate(everyone):
                groups.setdefault(v, []).append(r)
            detail = "ranks " + " / ".join(str(g) for g in groups.values()) + " yielded different batches"
        return (
            f"tnt.Model.{self.method}: the {self.what} yielded different data on the ranks at batch "
            f"{self.batch} (counted from 0 since it was passed): {detail}. Every rank iterates it "
            "and keeps its rows of each global batch, so it must yield the same batches on every "
            "rank: seed its randomness alike (keras.utils.set_random_seed(seed) or a seeded "
            "np.random.default_rng before creating it) and read the same data in the same order, "
            "or pass a keras.utils.PyDataset, which ranks index instead of iterating.")


def _rank_stream(source: Callable[[], Iterable], *, rank: int, size: int, with_sizes: bool,
                 class_weight: dict | None, checker: SameOnRanks, method: str, what: str) -> Iterator:
    for batch in source():
        batch = with_class_weight(standardize(batch, method, what), class_weight, method)
        checker.check(batch)
        yield cut(batch, rank, size, with_sizes)
    checker.check(None)


def _no_prefetch(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Reads happen when a step reads, never ahead: every rank compares the same batches."""
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    return dataset.with_options(options)


def iterated_dataset(x, *, rank: int, size: int, with_sizes: bool, class_weight: dict | None,
                     method: str) -> tf.data.Dataset:
    """A generator or DataLoader as a dataset of this rank's micro-batches, read as Keras
    reads it: a generator once (its first two batches peeked for the structure, then
    yielded again, as Keras' generator adapter does), a DataLoader anew each epoch (its
    first batches read once for the structure, with its length as the epoch's)."""
    loader = is_torch_loader(x)
    what = "DataLoader" if loader else "generator"
    if loader:
        first = list(itertools.islice(x, _SPEC_BATCHES))

        def source():
            return iter(x)
    else:
        first = list(itertools.islice(x, _SPEC_BATCHES))

        def source():
            return itertools.chain(first, x)
    if not first:
        raise InputError(f"tnt.Model.{method}: the {what} yielded no batch.")
    shaped = [cut(with_class_weight(standardize(b, method, what), class_weight, method), rank, size,
                  with_sizes) for b in first]
    checker = SameOnRanks(method, what)
    dataset = tf.data.Dataset.from_generator(
        lambda: _rank_stream(source, rank=rank, size=size, with_sizes=with_sizes,
                             class_weight=class_weight, checker=checker, method=method, what=what),
        output_signature=element_spec(shaped))
    if loader and hasattr(getattr(x, "dataset", None), "__len__"):  # Keras' rule for its length
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(len(x)))
    return _no_prefetch(dataset)


def python_input(x, *, rank: int, size: int, with_sizes: bool, class_weight: dict | None,
                 shuffle_seed: int | None, method: str):
    """This rank's input for Keras made from a PyDataset, generator or DataLoader."""
    if isinstance(x, keras.utils.PyDataset):
        return RankPyDataset(x, rank=rank, size=size, with_sizes=with_sizes, class_weight=class_weight,
                             shuffle_seed=shuffle_seed, method=method)
    return iterated_dataset(x, rank=rank, size=size, with_sizes=with_sizes, class_weight=class_weight,
                            method=method)


_RAISED_IN_DATA = re.compile(r"InputError: (tnt\.Model\.[^\n]*)")


@contextlib.contextmanager
def input_errors() -> Iterator[None]:
    """Re-raise an InputError raised while TensorFlow read a batch (TensorFlow reports it
    as an InvalidArgumentError whose text holds ours) as the InputError it is."""
    try:
        yield
    except tf.errors.OpError as err:
        found = _RAISED_IN_DATA.search(str(err))
        if found is None:
            raise
        raise InputError(found.group(1)) from err
