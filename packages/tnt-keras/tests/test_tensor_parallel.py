"""ParallelStrategy.TENSOR on 2 ranks (t = 2) equals serial Keras; plan and errors.

Cases: an MLP stack (SGD momentum, Adam) and a Transformer encoder block (Embedding by
vocabulary, attention by heads with dropout, an FFN pair with Dropout inside, LayerNorm
and residuals replicated; Adam). A float16 Dense pair with a LossScaleOptimizer whose
gradients overflow on one shard only skips exactly the steps serial Keras skips.

One job (jobs/tensor_parallel.py, in the shared 2-rank launch) trains each case serially and tensor-parallel in the
same job. Tolerances are those of float32 summation order, as in test_exactness.py.
"""

from __future__ import annotations

import pytest
from conftest import assert_check, launch, print_diff_table, share

RANKS = 2
CASES = ("mlp_sgd_momentum", "mlp_adam", "block_adam")
CHECKS = (
    "plan_mlp", "plan_embed", "plan_dropout", "plan_block", "plan_heads_not_divisible_replicated",
    "plan_non_divisible_replicated_with_note",
    "plan_default_keeps_small_lone_dense_replicated", "plan_t1_replicates_all",
    "error_subclassed", "error_t_below_1", "error_t_not_job_size", "error_size_with_data_strategy",
    "error_missing_size", "error_clipnorm", "error_load_weights_file_as_model",
    "unseeded_shuffle_same_batches_on_all_ranks",
    "deferred_build_split_layers_never_whole", "deferred_build_starts_and_trains_as_eager",
    "verify_group_sees_a_drifted_whole_copy_in_a_split_layer",
    "loss_scale_decided_as_serial_on_every_rank",
)


share(__name__, RANKS, "tensor_parallel", "tensor_parallel.py")  # in the shared 2-rank launch (shared_launch.py)


@pytest.fixture(scope="module")
def report(shared_launches):
    result = shared_launches.result(RANKS, "tensor_parallel")
    assert result["ranks"] == RANKS
    print_diff_table(f"tensor parallel t={RANKS}", result["cases"])
    s = result["saving"]
    print(f"save/load: plain Keras predict {s['plain_predict_diff']:.2e}, optimizer {s['plain_optimizer_diff']:.2e}; "
          f"serial file continued at t={RANKS}: history {s['continue_history_diff']:.2e}, weights "
          f"{s['continue_weight_diff']:.2e}; resumed backup: weights {s['resume_weight_diff']:.2e}\n"
          "seconds (wall, most CPU of a rank): " +
          ", ".join(f"{k} {w:.1f} / {c:.1f}" for k, (w, c) in s["seconds"].items()))
    result["work"] = shared_launches.out_file(RANKS, "tensor_parallel").parent
    return result


def test_every_case_ran(report):
    assert sorted(report["cases"]) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_matches_serial(report, case):
    c = report["cases"][case]
    assert c["start_same"], "the tensor-parallel model did not start from the serial weights"
    assert c["history_diff"] <= c["tol_loss"], c["history_diff"]
    assert c["evaluate_diff"] <= c["tol_loss"], c["evaluate_diff"]
    assert c["weight_diff"] <= c["tol_weights"], c["weight_diff"]
    assert c["predict_diff"] <= c["tol_weights"], c["predict_diff"]


@pytest.mark.parametrize("case", CASES)
def test_every_rank_sees_the_same_logs_and_weights(report, case):
    c = report["cases"][case]
    assert c["histories_per_rank_equal"]
    assert c["weights_per_rank_equal"]
    assert c["gathered_shapes"] == c["serial_shapes"]


@pytest.mark.parametrize("case", CASES)
def test_replicated_variables_bitwise_equal_in_group(report, case):
    sums = report["cases"][case]["replicated_checksums"]
    assert len(sums) == RANKS and len(set(sums)) == 1, sums


def test_each_rank_holds_only_its_shards(report):
    local = report["cases"]["mlp_adam"]["local_shapes"]
    for rank_vars in local:
        shapes = {path.split("/")[0] + "/" + path.rsplit("/", 1)[-1]: s for path, s in rank_vars.items()}
        assert shapes["up1/kernel"] == [10, 8] and shapes["up1/bias"] == [8]      # column: 16 / 2
        assert shapes["down1/kernel"] == [8, 12] and shapes["down1/bias"] == [12]  # row: bias whole
        assert shapes["up2/kernel"] == [12, 12] and shapes["down2/kernel"] == [12, 8]
        assert shapes["head/kernel"] == [8, 2] and shapes["head/bias"] == [2]      # column+allgather
    for rank_vars in report["cases"]["block_adam"]["local_shapes"]:
        assert rank_vars["emb/embeddings"] == [15, 16]                     # vocab rows: 30 / 2
        assert rank_vars["mha/query/kernel"] == [16, 2, 4]                 # 4 heads / 2
        assert rank_vars["mha/value/bias"] == [2, 4]
        assert rank_vars["mha/attention_output/kernel"] == [2, 4, 16]      # rows of its heads
        assert rank_vars["mha/attention_output/bias"] == [16]              # whole, added once
        assert rank_vars["ln1/gamma"] == [16] and rank_vars["ffn_up/kernel"] == [16, 16]


def test_optimizer_slots_are_shard_shaped(report):
    for slots in report["cases"]["mlp_adam"]["optimizer_slot_shapes"]:
        shapes = {tuple(s) for s in slots}
        assert (10, 8) in shapes and (10, 16) not in shapes, shapes


@pytest.mark.parametrize("name", CHECKS)
def test_plan_and_errors(report, name):
    assert_check(report["checks"], name)


def test_loss_scale_decision_spans_the_tensor_group(monkeypatch):
    """_loss_scale.decide_over_group, in one process (the group's allreduce faked): a rank
    whose own shards are finite skips the step when another rank's shard overflowed."""
    import types

    import keras
    import numpy as np

    from tarantella.tensor_parallel import _loss_scale

    others_bad = [0.0]
    monkeypatch.setattr(_loss_scale._gc, "allreduce", lambda bad, comm, chain, name: bad + others_bad[0])
    v = keras.Variable(np.ones(2, "float32"))
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=4.0)
    _loss_scale.decide_over_group(lso, types.SimpleNamespace(size=2, comm=None))
    lso.apply([np.full(2, 4.0, "float32")], [v])  # no rank overflowed: applied (4 / scale 4)
    assert v.numpy().tolist() == [0.0, 0.0] and float(lso.dynamic_scale.numpy()) == 4.0
    others_bad[0] = 1.0
    lso.apply([np.full(2, 4.0, "float32")], [v])  # finite here, not on the other rank: skipped
    assert v.numpy().tolist() == [0.0, 0.0] and float(lso.dynamic_scale.numpy()) == 2.0
    assert int(lso.iterations.numpy()) == 1
    alone = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    _loss_scale.decide_over_group(alone, types.SimpleNamespace(size=1, comm=None))  # t = 1: as Keras
    assert "check_finite" not in vars(alone)


# -- save / load -------------------------------------------------------------------------------------
TOL_LOSS, TOL_WEIGHTS = 1e-5, 2e-5  # the data-parallel tolerances


def test_tensor_save_opens_in_plain_keras(report):
    s = report["saving"]
    assert s["plain_predict_diff"] <= TOL_WEIGHTS and s["plain_weight_diff"] <= TOL_WEIGHTS, s
    # Adam's slots were split with their variables and joined again in the serial order
    assert s["plain_optimizer_diff"] <= TOL_WEIGHTS, s["plain_optimizer_diff"]
    assert s["plain_iterations"] == s["serial_iterations"] > 0, s


def test_save_streams_slices_to_the_master_and_writes_keras_own_file(report):
    """The master joins each split variable from the group's slices just before writing it:
    it receives slices only (never a joined variable: the gathered path's allgather handed
    it whole ones, 2048 B here and 4 MiB for the wide model), allocates about one variable
    while it saves (the gathered path: 45 MiB for the wide model's 36 MiB of state), and
    the file is Keras' own save of the gathered model, entry for entry."""
    s = report["saving"]
    assert 0 < s["save_largest_message_bytes"] <= s["largest_variable_bytes"] // RANKS, s
    assert s["streamed_entries"] > 0 and s["streamed_differing_entries"] == [], s
    assert s["streamed_same_config"] and s["streamed_same_members"], s
    assert 0 < s["wide_save_largest_message_bytes"] <= s["wide_largest_variable_bytes"] // RANKS, s
    assert s["wide_save_traced_peak_bytes"] <= 2 * s["wide_largest_variable_bytes"] < s["wide_state_bytes"] / 4, s


def test_serial_save_loads_tensor_parallel_and_continues_as_serial(report):
    s = report["saving"]
    assert s["continue_history_diff"] <= TOL_LOSS, s["continue_history_diff"]
    assert s["continue_weight_diff"] <= TOL_WEIGHTS, s["continue_weight_diff"]
    for shapes in s["continue_local_shapes"]:
        assert shapes["mha/query/kernel"] == [16, 2, 4], shapes  # 4 heads over 2 ranks


def test_load_reads_only_each_ranks_slices(report):
    s = report["saving"]
    assert s["load_leaves_serial_split_layers_unmaterialised"]
    for rank in s["load_reads"]:
        assert rank["sliced"] == rank["expected_sliced"] > 0 and rank["all_slices_1_of_t"], rank


def test_saved_at_t2_loads_at_t1_with_the_same_predictions(report):
    """In this (1-rank) process: the job's t = 2 file split over q = 1 predicts as the
    serial model it was trained beside."""
    import numpy as np

    import tarantella as tnt

    work = report["work"]
    loaded = tnt.models.load_model(work / "tp.keras", parallel_strategy=tnt.ParallelStrategy.TENSOR,
                                   tensor_parallel_size=1)
    predicted = loaded.predict(np.load(work / "tp_x.npy"), verbose=0)
    assert np.max(np.abs(predicted - np.load(work / "tp_predict_serial.npy"))) <= TOL_WEIGHTS


def test_checkpoint_callbacks_write_serial_files(report):
    s = report["saving"]
    assert s["files"] == sorted([f"ckpt_{e}.keras" for e in (1, 2)] +
                                [f"ckpt_{e}.weights.h5" for e in (1, 2)]), s["files"]
    assert s["checkpoint_weight_diff"] == 0 and s["checkpoint_weights_only_diff"] == 0, s
    assert s["backup_dir_removed"]  # BackupAndRestore deletes its backup after a complete run


def test_backup_and_restore_resumes_as_the_uninterrupted_run(report):
    s = report["saving"]
    assert s["resumed_epochs"] == 1, s  # of 2: the backup was taken after epoch 1
    assert s["resume_history_diff"] <= TOL_LOSS and s["resume_weight_diff"] <= TOL_WEIGHTS, s


# -- t = 3 (a 3-rank launch) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report_t3(report, tmp_path_factory):
    """jobs/tensor_parallel.py on 3 ranks: mlp3 (widths divisible by 3) trained at t = 3,
    its serial file and the 2-rank job's t = 2 file loaded at q = 3."""
    out = tmp_path_factory.mktemp("tensor3") / "tensor_parallel_3.json"
    result = launch(3, "tensor_parallel.py", out, "--t2-file", str(report["work"]))
    assert result["ranks"] == 3
    print_diff_table("tensor parallel t=3", result["cases"])
    print(f"loading at q=3: {result['loading']}")
    return result


def test_t3_matches_serial_with_every_layer_split(report_t3):
    c = report_t3["cases"]["mlp3_adam"]
    assert c["plan"] == {"up1": "column", "down1": "row", "up2": "column", "down2": "row",
                         "head": "column+allgather"}
    assert c["start_same"] and c["histories_per_rank_equal"] and c["weights_per_rank_equal"]
    assert c["history_diff"] <= c["tol_loss"] and c["evaluate_diff"] <= c["tol_loss"], c
    assert c["weight_diff"] <= c["tol_weights"] and c["predict_diff"] <= c["tol_weights"], c
    assert c["gathered_shapes"] == c["serial_shapes"]
    assert len(set(c["replicated_checksums"])) == 1 and len(set(c["shard_checksums"])) == 3
    for rank_vars in c["local_shapes"]:
        assert rank_vars["up1/kernel"] == [10, 6] and rank_vars["down1/kernel"] == [6, 12], rank_vars
        assert rank_vars["down2/kernel"] == [8, 9] and rank_vars["head/kernel"] == [9, 2], rank_vars


def test_jit_compile_has_xla_compile_the_segments_between_collectives(report_t3):
    """jit_compile=True: XLA auto-clusters segments of the tensor-parallel step on every
    rank (none before: the setting is scoped to tnt's calls), results within tolerance."""
    c = report_t3["cases"]["mlp3_adam_jit"]
    assert c["clustered_before"] == 0 and c["jit_setting_after"] == "", c
    assert all(n >= 1 for n in c["clustered_graphs"]), c["clustered_graphs"]
    assert c["start_same"] and c["histories_per_rank_equal"] and c["weights_per_rank_equal"]
    assert c["history_diff"] <= c["tol_loss"] and c["evaluate_diff"] <= c["tol_loss"], c
    assert c["weight_diff"] <= c["tol_weights"] and c["predict_diff"] <= c["tol_weights"], c


def test_serial_and_t2_files_load_at_q3_with_the_same_predictions(report_t3):
    s = report_t3["loading"]
    assert s["serial_file_predict_diff"] <= TOL_WEIGHTS, s
    assert s["serial_file_plan"] == {"up1": "column", "down1": "row", "up2": "column", "down2": "row"}, s
    for shapes in s["serial_file_local_shapes"]:   # the automatic plan: the small head whole
        assert shapes["up2/kernel"] == [12, 8] and shapes["head/bias"] == [6], shapes
    assert s["t2_file_plan"] == {"emb": "vocab"}, s   # 4 heads, ffn 32, head 4: not divisible by 3
    assert s["t2_file_predict_diff"] <= TOL_WEIGHTS, s
