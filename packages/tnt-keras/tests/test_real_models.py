"""keras-hub Transformers (GPT-2, BERT, Llama backbones with a head; the GPT2CausalLM task
model with its tied embedding), built from constructor arguments, trained with tnt.Model
on 2 ranks against serial Keras in the same job (jobs/real_models.py).

Each looks tokens up in an Embedding whose gradient is a tf.IndexedSlices; with Adam the
result equals serial Keras only if the slices reach the optimizer as serial Keras hands
them over (densified, History was off by 0.016-0.17 and weights by 0.03-0.06: issue 27).
"""

from __future__ import annotations

import pytest

CASES = ["gpt2", "bert", "llama", "gpt2_causal_lm"]
TOL_LOSS, TOL_WEIGHTS = 1e-5, 2e-5  # float32 summation order, as tests/test_exactness.py


@pytest.fixture(scope="module")
def report(real_models_parts):
    result = {"cases": real_models_parts["data"]}  # the shared 2-rank launch (conftest.py)
    print("\nkeras-hub models, DATA on 2 ranks (max abs difference to serial Keras)")
    for name, c in result["cases"].items():
        print(f"{name:16} history {c['history_diff']:.2e}  weights {c['weight_diff']:.2e}  "
              f"predict {c['predict_diff']:.2e}")
    return result["cases"]


def test_every_case_ran(report):
    assert sorted(report) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_history_weights_and_predictions_equal_serial(report, name):
    c = report[name]
    assert c["history_diff"] <= TOL_LOSS, c
    assert c["weight_diff"] <= TOL_WEIGHTS, c
    assert c["predict_diff"] <= TOL_WEIGHTS, c


@pytest.mark.parametrize("name", CASES)
def test_history_keys_are_serial_and_replicas_identical(report, name):
    c = report[name]
    serial_keys, tnt_keys = c["history_keys"]
    assert tnt_keys == serial_keys, c
    assert c["ranks_identical"], c
