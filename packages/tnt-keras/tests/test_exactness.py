"""tnt.Model on 1, 2 and 3 ranks gives serial Keras' History, weights, evaluate and predict.

The serial reference is plain ``keras.Model.fit`` computed inside the same job. The
tolerances are those of float32 summation order (docs/architecture.md, "The promise"): a looser
one would hide a real bug. The 2-rank launch runs every case. An optimizer only ever
sees the global gradient, the same whatever N, so the other launches run a subset: on 1
rank (Keras' own step) one case per model kind and input form plus jit; on 3 ranks the
global batches whose last batch is smaller than 3 or that divide by 3, dense, sparse
(Embedding) and dict inputs with sample weights.
"""

from __future__ import annotations

import pytest
from conftest import print_diff_table, share

EXPECTED_CASES = 16
#: The 1-rank launch: each model kind and input form once, and jit_compile.
ONE_RANK_CASES = ["dense_adam_B12_last1", "cnn_momentum_B10_last3", "tuple_inputs_weights_l2_adam",
                  "dict_inputs_weights_l2_rmsprop", "dense_adam_B11_last2_xla", "embedding_adam_B8_exact",
                  "embedding_adam_B10_last1"]
#: The 3-rank launch: last batches of 1 and 2 samples (< 3 ranks) and B % 3 == 0 (each case
#: ~11 s of the oversubscribed launch: the model kinds and jit stay at 1 and 2 ranks).
THREE_RANK_CASES = ["dense_adam_B12_last1", "embedding_adam_B10_last1", "dict_inputs_weights_l2_rmsprop",
                    "dense_momentum_B11_last1", "dense_adagrad_B13_last2", "dense_adadelta_B12_exact"]
SUBSET = {1: ONE_RANK_CASES, 3: THREE_RANK_CASES}


for _ranks in (1, 2, 3):  # in the shared launches (shared_launch.py)
    share(__name__, _ranks, "exactness", "exactness.py",
          *(("--only", ",".join(SUBSET[_ranks])) if _ranks in SUBSET else ()))


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}ranks")
def report(request, shared_launches):
    result = shared_launches.result(request.param, "exactness")
    assert result["ranks"] == request.param
    print_diff_table(f"exactness on {request.param} ranks", result["cases"])
    return result


def test_every_case_ran(report):
    if report["ranks"] in SUBSET:
        assert sorted(report["cases"]) == sorted(SUBSET[report["ranks"]])
    else:
        assert len(report["cases"]) == EXPECTED_CASES


def test_history_matches_serial(report):
    bad = {n: c["history_diff"] for n, c in report["cases"].items() if not c["history_diff"] <= c["tol_loss"]}
    assert not bad, f"History differs from serial beyond tolerance: {bad}"


def test_history_has_validation_and_metrics(report):
    for name, c in report["cases"].items():
        assert c["history_keys"] == ["accuracy", "loss", "val_accuracy", "val_loss"], name


def test_final_weights_match_serial(report):
    bad = {n: c["weight_diff"] for n, c in report["cases"].items() if not c["weight_diff"] <= c["tol_weights"]}
    assert not bad, f"final weights differ from serial beyond tolerance: {bad}"


def test_evaluate_matches_serial(report):
    bad = {n: c["evaluate_diff"] for n, c in report["cases"].items() if not c["evaluate_diff"] <= c["tol_loss"]}
    assert not bad, f"evaluate differs from serial: {bad}"


def test_predict_matches_serial_in_order(report):
    for name, c in report["cases"].items():
        assert c["predict_rows"][0] == c["predict_rows"][1] == 29, name
        assert c["predict_diff"] <= c["tol_weights"], (name, c["predict_diff"])


def test_weights_identical_on_all_ranks(report):
    assert all(c["ranks_identical"] for c in report["cases"].values())
