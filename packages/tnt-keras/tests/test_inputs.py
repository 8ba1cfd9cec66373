"""Python inputs on N ranks (issue 33): keras.utils.PyDataset, generators, DataLoaders.

One launched job per rank count (jobs/inputs.py) trains plain Keras and tnt.Model on
identical inputs and compares History, weights, evaluate and predict; it also records
the rows each rank loaded through ``get_rows`` and the error each rank raised when one
rank's generator yields other data.
"""

from __future__ import annotations

import math

import pytest
from conftest import launch, print_diff_table

TOL_LOSS, TOL_WEIGHTS = 1e-5, 2e-5  # float32 summation order, as tests/test_exactness.py
B, N_TRAIN, N_VAL = 8, 42, 19  # as in jobs/inputs.py
EXACT = {2: ["pydataset", "generator", "loader_like", "pipelining", "tensor"],
         3: ["pydataset", "generator"]}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def report(request, tmp_path_factory):
    ranks = request.param
    out = tmp_path_factory.mktemp(f"inputs{ranks}") / "inputs.json"
    result = launch(ranks, "inputs.py", out)
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
    # Each rank loads about 1/N of the rows serial Keras loads (both read the first two
    # batches once more to tell the element structure; prefetching may read a few ahead).
    for r, (train, val) in enumerate(c["rank_loaded"]):
        assert train <= c["serial_loaded"][0] / ranks + 2 * B, (r, c["rank_loaded"], c["serial_loaded"])
        assert val <= c["serial_loaded"][1] / ranks + 2 * 7, (r, c["rank_loaded"], c["serial_loaded"])


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
    if "torch" not in cases:
        pytest.skip("the torch case runs on 2 ranks")
    c = cases["torch"]
    if "skipped" in c:
        pytest.skip(c["skipped"])  # only when torch is not importable (see jobs/inputs.py)
    assert c["history_diff"] <= TOL_LOSS, c
    assert c["weight_diff"] <= TOL_WEIGHTS, c
    assert c["predict_diff"] <= TOL_WEIGHTS, c
