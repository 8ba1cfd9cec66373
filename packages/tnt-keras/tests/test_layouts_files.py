"""Every layout saves, loads and exports alike (issue 28): launched on 2 and 4 ranks
(jobs/layouts_files.py, in the shared launch of each rank count); see the job's docstring for what each case does.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from conftest import share

import tarantella as tnt

EXPECTED = {
    2: {"data": "Model", "pipelining_p2": "PipelinedModel", "tensor_t2": "TensorParallelModel",
        "all_t2": "TensorParallelModel"},
    4: {"data": "Model", "pipelining_p4": "PipelinedModel", "tensor_t4": "TensorParallelModel",
        "all_p2_t2": "TensorPipelinedModel", "all_p2_replicas2": "PipelinedModel"},
}
STEPS = 4  # 32 samples, global batch 8
TOL = 2e-5


for _ranks in EXPECTED:
    share(__name__, _ranks, "layouts_files", "layouts_files.py")  # in the shared launches (shared_launch.py)


@keras.saving.register_keras_serializable(package="tnt_tests")
class WithDefaults(keras.Model):
    """The job's model class (jobs/layouts_files.py), registered here to load its files
    in this process (its compile's default metric does not matter here)."""


def _report(ranks: int, shared_launches) -> dict:
    """The job's report on ``ranks`` ranks (the shared launch of that rank count; a failed
    launch is not rerun by each later test)."""
    result = shared_launches.result(ranks, "layouts_files")
    assert result["ranks"] == ranks
    result["work"] = shared_launches.out_file(ranks, "layouts_files").parent
    return result


@pytest.fixture(params=sorted(EXPECTED), ids=lambda n: f"{n}ranks")
def report(request, shared_launches):
    return _report(request.param, shared_launches)


def test_every_layout_ran_as_the_class_it_claims(report):
    got = {name: case["class"] for name, case in report["layouts"].items()}
    assert got == EXPECTED[report["ranks"]]


def test_pipelines_print_their_schedule_as_a_grid(report):
    grids = {name: case["schedule_grid_first_line"] for name, case in report["layouts"].items()
             if "schedule_grid_first_line" in case}
    expected = {2: {"pipelining_p2": "1f1b: 2 stages, 2 micro-batches"},
                4: {"pipelining_p4": "1f1b: 4 stages, 2 micro-batches",
                    "all_p2_t2": "1f1b: 2 stages, 2 micro-batches",
                    "all_p2_replicas2": "1f1b: 2 stages, 2 micro-batches"}}[report["ranks"]]
    assert sorted(grids) == sorted(expected), grids
    assert all(grids[name].startswith(expected[name] + ",") for name in expected), grids


def test_save_model_writes_one_plain_keras_file_with_the_optimizer_state(report):
    for name, case in report["layouts"].items():
        assert case["saved_predict_diff"] <= TOL, (name, case)
        assert case["saved_iterations"] == STEPS, (name, case)


def test_save_weights_writes_the_optimizer_state(report):
    for name, case in report["layouts"].items():
        assert case["weights_file_optimizer_vars"] > 0, (name, case)


def test_overwrite_false_on_an_existing_path_raises_and_keeps_the_file(report):
    for name, case in report["layouts"].items():
        assert case["overwrite_false_raises"] == [True, True, True], (name, case)
        assert case["overwrite_false_kept_files"], (name, case)


def test_save_on_all_devices_gives_every_rank_the_whole_file(report):
    for name, case in report["layouts"].items():
        assert case["all_devices_files"] == [True] * report["ranks"], (name, case)
        assert case["all_devices_last_rank_predict_diff"] <= TOL, (name, case)


def test_export_serves_the_outputs_of_a_serial_export(report):
    for name, case in report["layouts"].items():
        assert case["export_serve_diff"] <= 1e-6, (name, case)


def test_history_has_serial_keras_keys_and_values_with_the_model_class_own_compile_defaults(report):
    for name, case in report["layouts"].items():
        keys = case["history_keys"]
        # loss, the explicit metric and the default weighted metric of the class's compile
        assert keys["serial"] == ["default_mae", "loss", "mse_metric"], (name, keys)
        assert keys["tnt"] == keys["serial"], (name, keys)
        assert case["history_diff"] <= 1e-5, (name, case["history_diff"])


def test_get_weights_is_the_serial_models_list_on_every_rank(report):
    for name, case in report["layouts"].items():
        per_rank = case["get_weights_vs_serial_per_rank"]
        assert len(per_rank) == report["ranks"] and max(per_rank) <= TOL, (name, per_rank)
        assert case["get_weights_vs_saved_file"] == 0.0, (name, case["get_weights_vs_saved_file"])


def test_set_weights_takes_a_serial_list_and_predicts_as_serial_keras(report):
    for name, case in report["layouts"].items():
        for key in ("set_then_predict_per_rank", "set_then_get_per_rank"):
            per_rank = case[key]
            assert len(per_rank) == report["ranks"] and max(per_rank) <= 1e-6, (name, key, per_rank)


def test_set_weights_with_a_wrong_list_raises_value_error_on_every_rank(report):
    for name, case in report["layouts"].items():
        for key, words in (("short_list_error_per_rank", "a list of 9 arrays, the model has 10 weights"),
                           ("wrong_shape_error_per_rank", "array 0 has shape (7, 7)")):
            errors = case[key]
            assert len(errors) == report["ranks"], (name, key, errors)
            assert all(e is not None and words in e and "get_weights()" in e for e in errors), (name, key, errors)
        assert max(case["weights_kept_after_errors_per_rank"]) == 0.0, (name, case)


def test_a_t2_file_loads_at_q1_as_data_replicas_and_on_one_rank(shared_launches):
    report = _report(2, shared_launches)  # the 2-rank job writes the t = 2 file
    got = report["t2_file_as_all_q1"]
    assert got["class"] == "Model" and got["predict_diff"] <= TOL, got
    # And in this 1-rank process: TENSOR with tensor_parallel_size=1.
    path = report["work"] / "tensor_t2.keras"
    x = np.random.default_rng(3).normal(size=(32, 6)).astype("float32")
    loaded = tnt.models.load_model(path, parallel_strategy=tnt.ParallelStrategy.TENSOR, tensor_parallel_size=1)
    assert isinstance(loaded, tnt.Model)
    assert np.max(np.abs(loaded.predict(x, verbose=0) - keras.saving.load_model(path).predict(x, verbose=0))) <= TOL
