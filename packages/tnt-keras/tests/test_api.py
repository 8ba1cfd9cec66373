"""tnt.Model's API on 2 ranks (and 1): sync, inputs, callbacks, save/load, errors.

One launched job per rank count runs every check (see jobs/api.py); each check is
asserted here by name so a failure says which behaviour broke and shows its numbers.
"""

from __future__ import annotations

import pytest
from conftest import assert_check, launched_checks, share

CHECKS = [
    "rank_api",
    "native_ops_used_and_equal_fallback",
    "initial_weights_broadcast_from_rank0",
    "recompile_resyncs_rank_local_weights",
    "numpy_inputs_equal_serial",
    "validation_split_equal_serial",
    "predict_full_on_every_rank",
    "early_stopping_serial_epoch",
    "reduce_lr_on_plateau_serial_rates",
    "learning_rate_scheduler_serial_rates",
    "csv_logger_equal_serial",
    "checkpoint_only_master_writes",
    "checkpoint_dirs_made_by_master_only",
    "progress_and_summary_only_on_master",
    "callback_master_only",
    "tensorboard_master_only",
    "mixed_precision_loss_scaled",
    "mixed_precision_overflow_as_serial",
    "batch_norm_small_batch_warning",
    "save_load_model_roundtrip",
    "save_load_weights_roundtrip",
    "config_json_clone",
    "no_temporary_files_left",
    "uncompiled_fit_error",
    "error_batch_size_with_dataset",
    "error_generator_input",
    "error_unbatched_without_micro_batch",
    "error_fit_before_compile",
    "unbatched_with_micro_batch_size_trains",
]


for _ranks in (2, 1):
    share(__name__, _ranks, "api", "api.py")  # in the shared launches (shared_launch.py)


@pytest.fixture(scope="module", params=[2, 1], ids=lambda n: f"{n}ranks")
def checks(request, shared_launches):
    return launched_checks(request.param, "api.py", shared_launches)


@pytest.mark.parametrize("name", CHECKS)
def test_check(checks, name):
    assert_check(checks, name)


def test_no_unlisted_checks(checks):
    assert sorted(checks) == sorted(CHECKS)
