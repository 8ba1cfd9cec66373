"""Python inputs on N ranks (issue 33): keras.utils.PyDataset, generators, DataLoaders.

One launched job per rank count (jobs/inputs.py) trains plain Keras and tnt.Model on
identical inputs and compares History, weights, evaluate and predict; it also records
the rows each rank loaded through ``get_rows`` and the error each rank raised when one
rank's generator yields other data.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
from conftest import print_diff_table, share

TOL_LOSS, TOL_WEIGHTS = 1e-5, 2e-5  # float32 summation order, as tests/test_exactness.py
B, N_TRAIN, N_VAL = 8, 42, 19  # as in jobs/inputs.py
EXACT = {2: ["pydataset", "generator", "loader_like", "pipelining", "tensor"],
         3: ["pydataset", "generator"]}


for _ranks in (2, 3):
    share(__name__, _ranks, "inputs", "inputs.py")  # in the shared launches (shared_launch.py)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def report(request, shared_launches):
    ranks = request.param
    result = shared_launches.result(ranks, "inputs")
    assert result["ranks"] == ranks
    cases = result["cases"]
    print_diff_table(f"Python inputs, DATA (PIPELINING/TENSOR cases: p/t = ranks) on {ranks} ranks",
                     {k: c for k, c in cases.items() if "history_diff" in c})
    rows = cases["pydataset"]
    print(f"PyDataset rows loaded (train: 3 epochs, evaluate): serial Keras {rows['serial_loaded']}, "
          f"each rank by get_rows {rows['rank_loaded']}")
    return ranks, cases


def _requests_of(rank: int, size: int, n: int, batch: int) -> list[list[int]]:
    """(batch, start, stop) that rank ``rank`` asks for, for a dataset of ``n`` rows in
    batches of ``batch``: the first n_i % size ranks take one more of batch i's n_i rows."""
    out = []
    for i in range(math.ceil(n / batch)):
        n_i = min(batch, n - i * batch)
        base, extra = divmod(n_i, size)
        start = rank * base + min(rank, extra)
        out.append([i, start, start + base + (1 if rank < extra else 0)])
    return out


def test_every_case_ran(report):
    ranks, cases = report
    assert set(EXACT[ranks]) | {"mismatch"} <= set(cases), sorted(cases)


def test_equal_to_serial_keras(report):
    ranks, cases = report
    for name in EXACT[ranks]:
        c = cases[name]
        assert c["history_keys"][0] == c["history_keys"][1], (name, c)
        assert c["history_diff"] <= TOL_LOSS, (name, c)
        assert c["weight_diff"] <= TOL_WEIGHTS, (name, c)
        assert c["evaluate_diff"] <= TOL_LOSS, (name, c)
        assert c["predict_diff"] <= TOL_WEIGHTS, (name, c)
        assert c["predict_rows"][0] == c["predict_rows"][1], (name, c)
        assert c["same_on_ranks"], (name, c)


def test_epochs_ran_as_asked(report):
    _, cases = report
    assert cases["pydataset"]["epochs"] == 3  # the on_epoch_end reshuffle ran twice
    assert cases["generator"]["epochs"] == 2


def test_get_rows_loads_only_the_ranks_rows(report):
    ranks, cases = report
    c = cases["pydataset"]
    for r in range(ranks):
        train, val = c["rank_calls"][r]
        assert train == _requests_of(r, ranks, N_TRAIN, B), (r, train)
        assert val == _requests_of(r, ranks, N_VAL, 7), (r, val)
    # Each rank loads its rows of every batch it trains on (3 epochs) or evaluates, plus its
    # rows of the first two batches, which Keras reads once more to tell the structure (as
    # serial Keras reads the whole first two batches): 1/N of serial Keras' loading.
    for r, (train, val) in enumerate(c["rank_loaded"]):
        own = [stop - start for _, start, stop in _requests_of(r, ranks, N_TRAIN, B)]
        own_val = [stop - start for _, start, stop in _requests_of(r, ranks, N_VAL, 7)]
        assert train == 3 * sum(own) + own[0] + own[1], (r, c["rank_loaded"], c["serial_loaded"])
        assert val == sum(own_val) + own_val[0] + own_val[1], (r, c["rank_loaded"], c["serial_loaded"])
    assert c["serial_loaded"] == [3 * N_TRAIN + 2 * B, N_VAL + 2 * 7], c["serial_loaded"]


def test_different_generators_raise_on_every_rank(report):
    ranks, cases = report
    errors = cases["mismatch"]["errors"]
    assert len(errors) == ranks
    for kind, message in errors:
        assert kind == "InputError", (kind, message)
        assert "the generator yielded different data on the ranks at batch 2" in message, message
        assert "seed" in message, message


def test_torch_dataloader(report):
    _, cases = report
    c = cases["torch"]
    if "skipped" in c:
        # torch is no dependency of tnt (issue 33): the case runs in `nox -s keras_torch`.
        # A job that skipped it although torch imports here is a failure, not a skip.
        assert importlib.util.find_spec("torch") is None, c
        pytest.skip(f"{c['skipped']}: torch is not installed (nox -s keras_torch installs it)")
    assert c["history_diff"] <= TOL_LOSS, c
    assert c["weight_diff"] <= TOL_WEIGHTS, c
    assert c["predict_diff"] <= TOL_WEIGHTS, c


# -- in-process checks of the splitting pieces (no launch) -----------------------------------------
def _py_inputs():
    from tarantella._core import py_inputs

    return py_inputs


class _Rows:
    """A PyDataset built lazily (keras imported by the test only)."""

    @staticmethod
    def make(n=10, batch=4, rows=True, bad_rows=False):
        import keras
        import numpy as np

        class Data(keras.utils.PyDataset):
            def __len__(self):
                return math.ceil(n / batch)

            def __getitem__(self, i):
                idx = np.arange(i * batch, min(n, (i + 1) * batch))
                return idx.astype("float32")[:, None], idx

        class RowData(Data):
            def num_rows(self, i):
                return min(batch, n - i * batch)

            def get_rows(self, i, start, stop):
                idx = np.arange(i * batch + start, i * batch + stop + (1 if bad_rows else 0))
                return idx.astype("float32")[:, None], idx

        return (RowData if rows else Data)()


@pytest.mark.parametrize("rows", [False, True], ids=["getitem", "get_rows"])
def test_rank_pydataset_slices_partition_each_batch(rows):
    py_inputs = _py_inputs()
    for size in (2, 3):
        parts = [py_inputs.RankPyDataset(_Rows.make(rows=rows), rank=r, size=size, with_sizes=True,
                                         class_weight=None, shuffle_seed=None, method="fit")
                 for r in range(size)]
        for i in range(3):  # batches of 4, 4, 2 samples
            got = [p[i] for p in parts]
            labels = [int(v) for (x, y), sizes in got for v in y]
            assert labels == list(range(4 * i, min(10, 4 * i + 4))), (size, i, labels)
            n_i = len(labels)
            assert [int(s.local[0]) for _, s in got] == [n_i // size + (r < n_i % size) for r in range(size)]
            assert {int(s.total[0]) for _, s in got} == {n_i}


def test_rank_pydataset_shuffle_is_one_permutation_per_epoch_on_every_rank():
    py_inputs = _py_inputs()
    parts = [py_inputs.RankPyDataset(_Rows.make(n=40, batch=4), rank=r, size=2, with_sizes=False,
                                     class_weight=None, shuffle_seed=7, method="fit") for r in range(2)]
    orders = []
    for _ in range(2):  # two epochs
        firsts = [[int(p[i][1][0]) // 4 for i in range(10)] for p in parts]
        assert firsts[0] == firsts[1]  # the same batch order on both ranks
        assert sorted(firsts[0]) == list(range(10))  # every batch once
        orders.append(firsts[0])
        for p in parts:
            p.on_epoch_end()
    assert orders[0] != orders[1]  # a new order each epoch


def test_get_rows_errors_name_the_fix():
    py_inputs = _py_inputs()
    bad = py_inputs.RankPyDataset(_Rows.make(bad_rows=True), rank=0, size=2, with_sizes=False,
                                  class_weight=None, shuffle_seed=None, method="fit")
    with pytest.raises(py_inputs.InputError, match=r"get_rows\(0, 0, 2\) returned 3 rows, not 2"):
        bad[0]
    data = _Rows.make(rows=False)
    data.get_rows = lambda i, start, stop: None
    with pytest.raises(py_inputs.InputError, match="Define num_rows too"):
        py_inputs.RankPyDataset(data, rank=0, size=2, with_sizes=False, class_weight=None,
                                shuffle_seed=None, method="fit")


def test_fingerprint_sees_values_shapes_and_dtypes():
    import numpy as np

    fp = _py_inputs().fingerprint
    x = np.arange(12, dtype="float32").reshape(6, 2)
    base = fp((x, np.arange(6)))
    assert fp((x.copy(), np.arange(6))) == base
    assert fp((x + 1, np.arange(6))) != base
    assert fp((x[:5], np.arange(5))) != base
    assert fp((x.astype("float64"), np.arange(6))) != base
    assert fp((x,)) != base


def test_bad_batches_and_arguments_are_input_errors():
    import numpy as np

    from tarantella._core import inputs

    py_inputs = _py_inputs()
    with pytest.raises(py_inputs.InputError, match=r"must be a tuple \(x,\), \(x, y\)"):
        py_inputs.standardize((1, 2, 3, 4), "fit", "generator")
    sharding = inputs.Sharding(rank=0, size=2)

    def gen():
        yield np.zeros((2, 1)), np.zeros(2)

    with pytest.raises(py_inputs.InputError, match="batch_size= cannot be passed with a generator"):
        inputs.rank_dataset(gen(), batch_size=4, shuffle=False, sharding=sharding, method="fit")


def test_mismatch_messages_name_the_batch_and_the_ranks():
    checker = _py_inputs().SameOnRanks("evaluate", "generator")
    checker.batch = 5
    ended = checker._message([123, -1, 123])
    assert "at batch 5" in ended and "rank(s) [1] ended there while rank(s) [0, 2]" in ended, ended
    differ = checker._message([1, 2, 1])
    assert "tnt.Model.evaluate" in differ and "ranks [0, 2] / [1] yielded different batches" in differ


def test_input_error_raised_in_a_batch_read_comes_out_as_input_error():
    import tensorflow as tf

    py_inputs = _py_inputs()

    def bad():
        yield (tf.zeros((1, 1)),)
        raise py_inputs.InputError("tnt.Model.fit: the generator yielded different data (test)")

    dataset = tf.data.Dataset.from_generator(bad, output_signature=(tf.TensorSpec((None, 1)),))
    with pytest.raises(py_inputs.InputError, match=r"^tnt.Model.fit: the generator yielded different data \(test\)$"):
        with py_inputs.input_errors():
            for _ in dataset:
                pass
