"""ParallelStrategy.ALL with tensor groups equals serial Keras, on 4 ranks (and 8, opt-in).

One 4-rank launch (jobs/tensor_all.py) runs two cases, each trained serially and in
parallel in the same job (global batch 11, a last partial batch of 3), Adam:

- ``mlp_adam_edited``: 2 data replicas x t = 2, an MLP with an *edited* plan (a replicated
  Dense pair, a split pair, a column+allgather head);
- ``staged_adam_pipeline``: 2 pipeline stages x t = 2 (one replica), an MLP cut by a
  SplitLayer, each stage's Dense pair column/row split over its tensor group, a replicated
  LayerNorm, 2 micro-batches.

Checked: History, evaluate, predict and the gathered (whole, serial-shaped) weights
against serial Keras; every rank holds the same logs and weights; replicated variables
bitwise equal where they must be; each rank holds only its shards.

The 8-rank launch (2 replicas x 2 stages x t = 2) is ``tests/large/`` (``nox -s keras_large``):
8 TensorFlow processes cost minutes on a 2-core machine, so it is outside the default suite.
"""

from __future__ import annotations

import pytest
from conftest import assert_one_model_across_replicas, print_diff_table, share

RANKS, T = 4, 2
PLANS = {
    "mlp_adam_edited": {"up2": "column", "down2": "row", "head": "column+allgather"},
    "staged_adam_pipeline": {"up1": "column", "down1": "row", "up2": "column", "down2": "row",
                             "head": "column+allgather"},
}


share(__name__, RANKS, "tensor_all", "tensor_all.py", "--only", ",".join(PLANS))  # shared_launch.py


@pytest.fixture(scope="module")
def report(shared_launches):
    result = shared_launches.result(RANKS, "tensor_all")
    assert result["ranks"] == RANKS
    print_diff_table(f"ALL: 2 replicas x t={T}; 2 stages x t={T}", result["cases"],
                     extra=lambda c: f"  wall {c['seconds'][0]:.1f} s, CPU of all ranks {c['seconds'][1]:.1f} s")
    return result


def _matches_serial(c: dict) -> None:
    assert c["start_same"], "the model did not start from the serial weights"
    assert c["history_diff"] <= c["tol_loss"], c["history_diff"]
    assert c["evaluate_diff"] <= c["tol_loss"], c["evaluate_diff"]
    assert c["weight_diff"] <= c["tol_weights"], c["weight_diff"]
    assert c["predict_diff"] <= c["tol_weights"], c["predict_diff"]
    assert c["histories_per_rank_equal"]
    assert c["weights_per_rank_equal"]
    assert c["gathered_shapes"] == c["serial_shapes"]


@pytest.mark.parametrize("case", sorted(PLANS))
def test_plan_from_layout_map_or_edit(report, case):
    assert report["cases"][case]["plan"] == PLANS[case]


@pytest.mark.parametrize("case", sorted(PLANS))
def test_matches_serial_and_every_rank_sees_the_same_logs_and_weights(report, case):
    _matches_serial(report["cases"][case])


def test_replicas_and_groups_hold_bitwise_equal_copies(report):
    c = report["cases"]["mlp_adam_edited"]   # rank = replica * 2 + shard
    replicated, shards = c["replicated_checksums"], c["shard_checksums"]
    assert len(replicated) == RANKS and len(set(replicated)) == 1, replicated
    assert shards[0] == shards[2] and shards[1] == shards[3], shards   # shard s in both replicas
    assert shards[0] != shards[1], "both ranks of a tensor group hold the same shard"


def test_pipeline_stages_tensor_groups_hold_equal_replicated_and_distinct_shards(report):
    c = report["cases"]["staged_adam_pipeline"]   # rank = stage * 2 + shard
    replicated, shards = c["replicated_checksums"], c["shard_checksums"]
    assert replicated[2] == replicated[3], replicated   # stage 1's LayerNorm in its tensor group
    assert len(set(shards)) == RANKS, shards


def test_each_rank_holds_only_its_shards(report):
    for rank_vars in report["cases"]["mlp_adam_edited"]["local_shapes"]:
        shapes = {path.split("/")[0] + "/" + path.rsplit("/", 1)[-1]: s for path, s in rank_vars.items()}
        assert shapes["up1/kernel"] == [10, 16] and shapes["down1/kernel"] == [16, 12]   # replicated
        assert shapes["up2/kernel"] == [12, 12] and shapes["down2/kernel"] == [12, 8]    # column / row
        assert shapes["head/kernel"] == [8, 2] and shapes["head/bias"] == [2]            # column+allgather


def test_each_pipeline_rank_holds_only_its_stages_shards(report):
    local = report["cases"]["staged_adam_pipeline"]["local_shapes"]
    for rank in (0, 1):   # stage 0: up1 / down1 split
        assert local[rank] == {"up1/kernel": [10, 8], "up1/bias": [8], "down1/kernel": [8, 12],
                               "down1/bias": [12]}, local[rank]
    for rank in (2, 3):   # stage 1: up2 / down2 split, LayerNorm whole, head column+allgather
        assert local[rank]["up2/kernel"] == [12, 12] and local[rank]["down2/kernel"] == [12, 8], local[rank]
        assert local[rank]["ln/gamma"] == [8] and local[rank]["head/kernel"] == [8, 2], local[rank]
        assert "up1/kernel" not in local[rank]
    for slots in report["cases"]["staged_adam_pipeline"]["optimizer_slot_shapes"]:
        assert [16, 12] not in slots and [10, 16] not in slots and [24, 8] not in slots, slots   # shard-shaped


# -- files under ALL ------------------------------------------------------------------------------------
TOL_LOSS, TOL_WEIGHTS = 1e-5, 2e-5  # the data-parallel tolerances


def test_replicas_checkpoints_are_serial_files_and_save_opens_in_plain_keras(report):
    s = report["saving"]
    assert s["files"] == sorted([f"ckpt_{e}.keras" for e in (1, 2)] +
                                [f"ckpt_{e}.weights.h5" for e in (1, 2)]), s["files"]
    assert s["checkpoint_weight_diff"] == 0 and s["checkpoint_weights_only_diff"] == 0, s
    assert s["backup_dir_removed"]
    assert s["plain_predict_diff"] <= TOL_WEIGHTS, s


def test_replicas_load_model_splits_the_file_over_each_replicas_group(report):
    s = report["saving"]
    assert s["load_all_replicas"] == 2, s
    assert s["load_all_predict_diff"] <= TOL_WEIGHTS, s


def test_replicas_backup_resumes_as_the_uninterrupted_run(report):
    s = report["saving"]
    assert s["resumed_epochs"] == 1, s  # of 2: the backup was taken after epoch 1
    assert s["resume_history_diff"] <= TOL_LOSS and s["resume_weight_diff"] <= TOL_WEIGHTS, s


def test_pipeline_stages_of_tensor_groups_save_opens_in_plain_keras(report):
    assert report["cases"]["staged_adam_pipeline"]["plain_predict_diff"] <= TOL_WEIGHTS


def test_pipeline_stages_of_tensor_groups_refuse_load_weights_naming_the_fix(report):
    error = report["cases"]["staged_adam_pipeline"]["load_weights_error"]
    assert "not available yet" in error and "keras.saving.load_model" in error, error


def test_replicas_average_batch_norm_statistics_so_every_rank_and_the_file_hold_one_model(report):
    # Tensor groups' data replicas track their own moving statistics (jobs/_replica_stats.py):
    # before the averaging fit ended in "weights differ between the data replicas".
    # Plain Keras computes the split Dense layers as one matmul each, the tensor groups as
    # partial products summed by an allreduce: equal within the data-parallel tolerance, and
    # bitwise on some CPUs only (5.96e-07 on an AMD EPYC, 2026-11-29; 0.0 on the CI machine).
    assert_one_model_across_replicas(report["batch_norm_replicas"], plain_keras_tol=TOL_WEIGHTS)
