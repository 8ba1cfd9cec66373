"""tnt.Model on 1, 2 and 3 ranks gives serial Keras' History, weights, evaluate and predict.

The serial reference is plain ``keras.Model.fit`` computed inside the same job. The
tolerances are those of float32 summation order (DESIGN.md, "The promise"): a looser
one would hide a real bug. On 1 rank tnt.Model runs Keras' own step, whatever the
optimizer, so that launch runs one case per model kind and input form (and the jit one)
rather than every optimizer.
"""

from __future__ import annotations

import pytest
from conftest import launch

EXPECTED_CASES = 13
#: The 1-rank launch: each model kind and input form once, and jit_compile.
ONE_RANK_CASES = ["dense_adam_B12_last1", "cnn_momentum_B10_last3", "tuple_inputs_weights_l2_adam",
                  "dict_inputs_weights_l2_rmsprop", "dense_adam_B11_last2_xla"]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}ranks")
def report(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("exact") / "exactness.json"
    only = ("--only", ",".join(ONE_RANK_CASES)) if request.param == 1 else ()
    result = launch(request.param, "exactness.py", out, *only)
    assert result["ranks"] == request.param
    rows = [f"{'case':34} {'hist':>9} {'weights':>9} {'eval':>9} {'predict':>9}"]
    for name, c in result["cases"].items():
        rows.append(f"{name:34} {c['history_diff']:9.2e} {c['weight_diff']:9.2e} "
                    f"{c['evaluate_diff']:9.2e} {c['predict_diff']:9.2e}")
    print(f"\nexactness on {request.param} ranks (max abs difference to serial Keras)\n" + "\n".join(rows))
    return result


def test_every_case_ran(report):
    want = len(ONE_RANK_CASES) if report["ranks"] == 1 else EXPECTED_CASES
    assert len(report["cases"]) == want


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
