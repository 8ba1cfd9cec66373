"""Every way a Keras user trains, on 1 and 2 ranks, against serial Keras in the same job.

One launched job per rank count (jobs/keras_api.py) runs every check; each is asserted
here by name, with its measured difference to serial in the failure message. The 2-rank
run uses global batches not divisible by the number of ranks and last batches smaller
than it. The same job on 3 ranks (oversubscribed on 2 cores: ~165 s of the suite) is in
the opt-in ``nox -s keras_large`` (large/test_keras_api_3ranks.py); the suite's 3-rank
launch keeps the uneven splits of fit/evaluate/predict (test_exactness, test_inputs).
"""

from __future__ import annotations

import pytest
from conftest import assert_check, launched_checks, share

CHECKS = [
    # issue: custom train_step / test_step / predict_step
    "gan_history",
    "gan_weights_both_submodels",
    "gan_trackers",
    "gan_custom_step_called",
    "gan_replicas_identical",
    "tracked_history",
    "tracked_weights",
    "custom_test_step_used",
    "custom_test_step_equal",
    "custom_predict_step_equal",
    # custom training loops
    "custom_loop_equal_batches",
    "custom_loop_equal_batches_replicas_identical",
    "custom_loop_weighted",
    "custom_loop_weighted_replicas_identical",
    "custom_loop_own_optimizer_replicas_identical",
    # sparse gradients (Embedding + Adam) in a custom train_step and a custom loop
    "sparse_custom_train_step_adam",
    "sparse_custom_loop_adam",
    "sparse_custom_loop_adam_replicas_identical",
    # B < N, drop_remainder, early / after-batch split
    "small_global_batches_equal_serial",
    "small_global_batches_same_steps",
    # NumPy inputs shuffled as plain Keras shuffles them
    "shuffled_arrays_equal_serial_script",
    "unseeded_shuffle_each_sample_once_per_epoch",
    # the rest of the Model API
    "predict_uncompiled",
    "load_model_compile_false_predict",
    "evaluate_without_optimizer",
    "class_weight_equal_serial",
    "weight_decay_skips_weights_without_gradient",
    "on_batch_equal_serial",
    "own_step_loss_scale_same_steps_applied",
    "own_step_loss_scale_equal_serial",
    "user_distributed_loss_scale_same_steps_applied",
    "user_distributed_loss_scale_equal_serial",
    "multi_output_per_output_losses",
    "export_serves_serial_outputs",
    "batch_norm_statistics_identical",
    "batch_norm_saved_file_holds_common_statistics",
    "unknown_model_kwarg_error",
    "unknown_cardinality_logs",
    "sync_batch_norm_option_equal_serial",
    "sync_batch_norm_layer_equal_serial",
    "sync_batch_norm_float64_equal_serial",
    "sync_batch_norm_layer_loads_as_plain_bn",
]


for _ranks in (1, 2):
    share(__name__, _ranks, "keras_api", "keras_api.py")  # in the shared launches (shared_launch.py)


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"{n}ranks")
def checks(request, shared_launches):
    found = launched_checks(request.param, "keras_api.py", shared_launches)
    rows = [f"{name:48} {c['diff'] if c['diff'] is not None else '':>10}" for name, c in found.items()]
    print(f"\nkeras_api on {request.param} ranks (max abs difference to serial)\n" + "\n".join(rows))
    return found


def test_no_job_step_failed(checks):
    failed = {k: v["detail"] for k, v in checks.items() if k.startswith("job_step_")}
    assert not failed, failed


@pytest.mark.parametrize("name", CHECKS)
def test_check(checks, name):
    assert_check(checks, name)
