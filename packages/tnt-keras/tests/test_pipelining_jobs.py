"""Pipelining on real ranks (jobs/pipeline.py through the launcher) against serial Keras.

Three jobs: PIPELINING on 2 and 3 ranks (one pipeline, one stage per rank) and ALL
on 4 ranks (two replicas of a 2-stage pipeline); fewer cannot cover p = 2 and 3 with N
ranks (PIPELINING needs N == p, ALL N % p == 0). The 2-rank job leaves its p = 2 file in
a directory the 3-rank job loads from (p = 2 -> q = 3). Tolerances are those of the
data-parallel tests (float32 summation order; docs/architecture.md, "The promise").

Each job runs its own cases and checks (EXPECTED_CASES, EXPECTED_CHECKS): a test is
parametrised over the jobs that carry what it checks, so no test passes on a job where
it checks nothing. Each job runs once per session, in the shared launch of its rank count
(shared_launch.py: launches go in ascending rank count, the 2-rank job before the 3-rank one).
"""

from __future__ import annotations

import re

import pytest
from conftest import assert_one_model_across_replicas, print_diff_table, share

TOL = {"mlp": (1e-5, 2e-5), "skip": (1e-5, 2e-5), "cnn": (1e-4, 1e-3), "lso": (1e-5, 2e-5),  # (losses, weights)
       "emb": (1e-5, 2e-5), "unused": (1e-5, 2e-5),
       # mixed_float16: float16 rounds to 2^-11 relative, so an activation can round the other
       # way after a float32 difference of 1e-7; about 1 float16 ulp of values ~1
       "f16": (1e-3, 1e-3)}

#: The layers whose gradients overflow at a loss-scaled case's first step (checked on the
#: serial model): stage 0's alone ("lso", float32) or the last stage's alone ("f16").
OVERFLOW_AT_START = {"lso": ["l0"], "f16": ["l1"]}


#: Metric and loss-tracker variables a stage holds besides its weights and optimizer.
METRIC_BYTES = 64

P2, P3, ALL4 = "pipelining_2ranks", "pipelining_3ranks", "all_4ranks"
#: job -> (ranks, layout).
JOBS = {P2: (2, "pipelining"), P3: (3, "pipelining"), ALL4: (4, "all")}
ALL_JOBS = list(JOBS)

#: The cases each job trains (jobs/pipeline.py, main).
EXPECTED_CASES = {
    P2: ["skip_p2_adam_clip_m4_1f1b", "mlp_p2_momentum_m3_gpipe", "mlp_p2_momentum_m3_1f1b",
         "mlp_p2_adam_m1_1f1b", "cnn_p2_momentum_m3_1f1b", "emb_p2_adam_m4_gpipe", "emb_p2_adam_m4_1f1b",
         "lso_p2_lso_spe3_m3_1f1b", "f16_p2_adam_m3_1f1b", "unused_p2_adamw_m2_1f1b",
         "emb_p2_adam_m4_gpipe_remat", "mlp_p2_adam_m4_1f1b", "mlp_p2_adam_m4_interleaved"],
    P3: ["skip_p3_adam_clip_m4_1f1b", "mlp_p3_adam_m4_gpipe", "mlp_p3_adam_m4_1f1b"],
    ALL4: ["mlp_all2x2_adam_m4_gpipe", "mlp_all2x2_adam_m4_1f1b", "emb_all2x2_adam_m3_1f1b",
           "lso_all2x2_lso_spe3_m3_1f1b", "f16_all2x2_adam_m3_1f1b", "unused_all2x2_adamw_m2_1f1b",
           "mlp_all2x2_adam_m4_1f1b_remat"],
}
#: The GPipe cases each job compares bitwise with their 1F1B twins.
EXPECTED_SCHEDULE_PAIRS = {
    P2: ["mlp_p2_momentum_m3_gpipe", "emb_p2_adam_m4_gpipe"],
    P3: ["mlp_p3_adam_m4_gpipe"],
    ALL4: ["mlp_all2x2_adam_m4_gpipe"],
}
#: The checks beside the cases each job runs (the report's other keys). The 3-rank job
#: loads the p = 2 file ("load_p2_file") only if the 2-rank job ran before it.
EXPECTED_CHECKS = {
    P2: {"gpipe_equals_1f1b", "save_load", "validation_split_history_diff", "unseeded_shuffle", "remat_equals_kept",
         "predict_uncompiled",
         "interleaved_equals_1f1b", "interleaved_save_load"},
    P3: {"gpipe_equals_1f1b", "load_p2_file", "backup_resume"},
    ALL4: {"gpipe_equals_1f1b", "save_load", "remat_equals_kept", "batch_norm_replicas"},
}
REPORT_FIELDS = {"ranks", "layout", "cases", "pid"}
#: The jobs that carry a check (where a test of it is generated).
SAVING_JOBS = [P2, ALL4]  # save/load: q = 1, 2 from p = 2; q = 2, 4 from ALL 2 x 2
LOSS_SCALE_JOBS = [P2, ALL4]  # the "lso" and "f16" cases (2 stages only)
REPLICATED_JOBS = [ALL4]  # more than one replica of each stage


#: The 2-rank job leaves its p = 2 save in the session's shared directory for the 3-rank job:
#: the session's launches go in ascending rank count (shared_launch.py), so it runs first.
for _job_name, (_ranks, _layout) in JOBS.items():  # in the shared launches (shared_launch.py)
    share(__name__, _ranks, _job_name, "pipeline.py", "--layout", _layout,
          *(("--shared", "{shared}") if _layout == "pipelining" else ()))


class _Launches:
    """Each job's report, from the shared launch of its rank count (a failed launch is not
    retried: every later test of that job fails with its error)."""

    def __init__(self, shared_launches) -> None:
        self.shared_launches = shared_launches
        self.reports: dict[str, dict] = {}

    def __getitem__(self, job: str) -> dict:
        if job not in self.reports:
            self.reports[job] = self._report(job)
        return self.reports[job]

    def _report(self, job: str) -> dict:
        ranks, layout = JOBS[job]
        result = self.shared_launches.result(ranks, job)
        assert result["ranks"] == ranks and result["layout"] == layout
        print_diff_table(f"pipelining, {layout} on {ranks} ranks", result["cases"], extra=lambda c: (
            f"  loss scale: serial {c['loss_scale']['serial']}, per rank {c['loss_scale']['per_rank']}"
            if c["loss_scale"] else ""))
        print(f"save/load: {result.get('save_load')}\nload p2 file: {result.get('load_p2_file')}"
              + f"\nbackup resume: {result.get('backup_resume')}"
              + f"\nunseeded shuffle: {result.get('unseeded_shuffle')}"
              + "\nmaterialised / stage / serial bytes per rank: "
              + "; ".join(f"{n}: {c['materialised_bytes_per_rank']} / {c['stage_training_bytes_per_rank']} / "
                          f"{c['serial_training_bytes']}" for n, c in result["cases"].items()))
        return result


@pytest.fixture(scope="module")
def launches(shared_launches):
    return _Launches(shared_launches)


@pytest.fixture
def report(job, launches):
    """The report of ``job``, the test's parametrisation (one of JOBS)."""
    return launches[job]


def on(*jobs: str):
    """Generate the test for these jobs only (those that carry what it checks)."""
    return pytest.mark.parametrize("job", list(jobs))


def _tol(name: str) -> tuple[float, float]:
    return TOL[name.split("_")[0]]


@on(*ALL_JOBS)
def test_every_case_ran(report, job):
    assert sorted(report["cases"]) == sorted(EXPECTED_CASES[job])


@on(*ALL_JOBS)
def test_every_check_ran_and_no_other(report, job, launches):
    """The job ran the checks beside its cases that it carries, and no other (the save/load,
    validation_split, backup/resume, p = 2 file and unseeded-shuffle checks each run on
    the jobs named in EXPECTED_CHECKS only)."""
    expected = set(EXPECTED_CHECKS[job])
    assert set(report) - REPORT_FIELDS == expected
    assert sorted(report["gpipe_equals_1f1b"]) == sorted(EXPECTED_SCHEDULE_PAIRS[job])


@on(*ALL_JOBS)
def test_history_evaluate_predict_and_weights_match_serial(report):
    for name, c in report["cases"].items():
        tol_loss, tol_w = _tol(name)
        assert c["history_diff"] <= tol_loss, (name, c["history_diff"])
        assert c["evaluate_diff"] <= tol_loss, (name, c["evaluate_diff"])
        assert c["weight_diff"] <= tol_w, (name, c["weight_diff"])
        assert c["predict_diff"] <= tol_w, (name, c["predict_diff"])
        assert c["predict_rows"] == [17, 17], name  # full output, in order, on every rank
        assert c["history_keys"] == ["accuracy", "loss", "val_accuracy", "val_loss"], name


@on(*ALL_JOBS)
def test_every_rank_sees_the_same_logs_and_predictions(report):
    assert all(c["same_logs_on_all_ranks"] for c in report["cases"].values())


@on(*ALL_JOBS)
def test_gpipe_and_1f1b_are_bitwise_identical(report):
    assert report["gpipe_equals_1f1b"] and all(report["gpipe_equals_1f1b"].values()), report["gpipe_equals_1f1b"]


@on(P2, ALL4)
def test_recomputing_stages_train_bitwise_as_keeping_activations(report):
    # remat="stages" (Note [Stage recomputation]) on real ranks: GPipe with sparse gradients
    # (p = 2), 1F1B over replicas (ALL 2 x 2); each against its twin that keeps activations
    twins = report["remat_equals_kept"]
    assert sorted(twins) == sorted(n for n in report["cases"] if n.endswith("_remat")) and twins, twins
    assert all(twins.values()), twins


@on(P2)
def test_interleaved_trains_bitwise_as_1f1b_and_saves_one_keras_file(report):
    # pipeline_schedule="interleaved", virtual_stages=2 on 2 ranks: 4 chunks, each rank two
    # non-adjacent ones; bitwise its 1F1B twin (and, as every case, serial Keras within TOL:
    # test_history_evaluate_predict_and_weights_match_serial)
    pairs = report["interleaved_equals_1f1b"]
    assert sorted(pairs) == ["mlp_p2_adam_m4_interleaved"] and all(pairs.values()), pairs
    sl = report["interleaved_save_load"]
    assert sl["chunks_per_rank"] == [2, 2] and sl["loaded_identical"], sl
    assert sl["plain_keras_weight_diff"] <= 2e-5 and sl["plain_keras_optimizer_diff"] <= 2e-5, sl
    assert sl["loaded_predict_diff"] <= 1e-5, sl


@on(*REPLICATED_JOBS)
def test_replicas_hold_bitwise_identical_stages(report):
    # Only where each stage has several replicas: with one rank per stage it holds trivially.
    assert report["layout"] == "all" and report["ranks"] == 4, (report["layout"], report["ranks"])
    assert all(c["replicas_identical"] for c in report["cases"].values())


@on(*ALL_JOBS)
def test_no_rank_holds_the_whole_model(report):
    for name, c in report["cases"].items():
        counts = c["variables_per_rank"]
        p = report["ranks"] if report["layout"] == "pipelining" else report["ranks"] // 2
        assert sum(counts[:p]) == c["serial_variables"], (name, counts)  # replica 0's stages
        assert max(counts) < c["serial_variables"], (name, counts)
        # The user's model was built deferred and stayed so; what each rank materialised
        # (every Keras variable with a value created since, found by scanning the process)
        # is its stage's weights and optimizer variables, less than the serial model's.
        assert c["user_model_stays_deferred"], name
        for made, stage in zip(c["materialised_bytes_per_rank"], c["stage_training_bytes_per_rank"]):
            assert stage <= made <= stage + METRIC_BYTES, (name, made, stage)
            assert stage < c["serial_training_bytes"], (name, stage, c["serial_training_bytes"])


def _assert_load_reads_only_the_stage(pairs, label):
    for made, stage in pairs:
        assert stage <= made <= stage + METRIC_BYTES, (label, made, stage)


@on(*ALL_JOBS)
def test_1f1b_holds_at_most_min_p_minus_s_m_micro_batches(report):
    p = report["ranks"] if report["layout"] == "pipelining" else report["ranks"] // 2
    for name, c in report["cases"].items():
        m = int(re.search(r"_m(\d+)_", name).group(1))
        expected = [min(p - r % p, m) if "_1f1b" in name else m for r in range(report["ranks"])]
        if name.endswith("_interleaved"):  # chunk activation sets (v = 2): the warm-up 2 (p - r - 1) + (v - 1) p,
            # + 1; the last batch's 3 micro-batches (no multiple of p) run all 2 x 3 chunk forwards first
            expected = [max(min(2 * (p - r - 1) + (2 - 1) * p + 1, 2 * m), 2 * 3) for r in range(p)]
        assert c["peak_in_flight"] == expected, (name, c["peak_in_flight"])


@on(*SAVING_JOBS)  # the 3-rank job does not save: these two cover q = 1, 2 and q = 2, 4
def test_save_gathers_one_plain_keras_file_and_loads_into_any_stage_count(report):
    sl = report["save_load"]
    assert sl["plain_keras_weight_diff"] <= 2e-5 and sl["plain_keras_has_optimizer_state"], sl
    assert sl["plain_keras_optimizer_diff"] <= 2e-5, sl
    loads = [k for k in sl if k.startswith("load_q") and k.endswith("_predict_diff")]
    assert loads, sl
    for key in loads:
        assert sl[key] <= 2e-5, (key, sl[key])
    assert any(k.startswith("load_q1_") for k in sl) == (report["layout"] == "pipelining"), sl
    for key in [k for k in sl if k.endswith("_materialised_vs_stage_bytes")]:
        _assert_load_reads_only_the_stage(sl[key], key)
    assert sl["continue_history_diff"] <= 1e-5 and sl["continue_weight_diff"] <= 2e-5, sl


@on(*SAVING_JOBS)
def test_save_streams_variables_to_the_master_and_writes_keras_own_file(report):
    """The master never receives a stage's payload whole (a gather would: a message of a
    whole stage, larger than any variable), and the file is Keras' own save of the serial
    model: the same entries and attributes, bitwise the same arrays, the same config."""
    sl = report["save_load"]
    assert 0 < sl["save_largest_message_bytes"] <= sl["largest_variable_bytes"], sl
    assert sl["streamed_entries"] > 0 and sl["streamed_differing_entries"] == [], sl
    assert sl["streamed_same_config"] and sl["streamed_same_members"], sl


@on(P2)
def test_validation_split_and_class_weight_match_serial(report):
    assert report["validation_split_history_diff"] <= 1e-5


@on(P3)
def test_file_saved_at_p2_loads_into_3_stages(report):
    got = report["load_p2_file"]
    assert got["stages"] == 3 and got["predict_diff"] <= 2e-5, got
    _assert_load_reads_only_the_stage(got["materialised_vs_stage_bytes"], "p2 -> q3")


@on(P3)
def test_backup_and_restore_resume_equals_uninterrupted_serial(report):
    got = report["backup_resume"]
    assert got["interrupted"] and got["resumed_epochs"] == 2, got
    assert got["history_diff"] <= 1e-5 and got["weight_diff"] <= 2e-5, got
    assert got["backup_removed"], got


@on(*LOSS_SCALE_JOBS)
def test_loss_scale_optimizer_skips_and_scales_as_serial_on_every_stage(report):
    """LossScaleOptimizer: one stage's overflow skips the step everywhere (History and
    weights are checked with the other cases); every rank ends with serial Keras' loss
    scale and number of applied steps. Stage 0 alone overflows first in the float32 case,
    the last stage alone in the mixed_float16 one: neither stage alone may decide."""
    cases = {n: c for n, c in report["cases"].items() if c["loss_scale"]}
    assert sorted(n.split("_")[0] for n in cases) == ["f16", "lso"], list(cases)
    for name, c in cases.items():
        ls = c["loss_scale"]
        # The case really overflows, at first on one stage only (the other alone must not
        # decide), and skips steps serially.
        assert ls["overflow_at_start"] == OVERFLOW_AT_START[name.split("_")[0]], (name, ls)
        scale, applied = ls["serial"]
        assert ls["steps"] - applied >= 3, (name, ls)
        assert all(r == [scale, applied] for r in ls["per_rank"]), (name, ls)


@on(*ALL_JOBS)
def test_no_loss_scale_outside_the_loss_scaled_cases(report):
    """Only the "lso" and "f16" cases carry a LossScaleOptimizer state (none on 3 stages)."""
    scaled = sorted(n for n, c in report["cases"].items() if c["loss_scale"])
    assert scaled == sorted(n for n in report["cases"] if n.split("_")[0] in ("lso", "f16")), scaled


@on(*LOSS_SCALE_JOBS)
def test_mixed_float16_case_computes_in_float16(report):
    """The mixed_float16 case is what it claims: a mixed_float16 model whose stages send
    float16 activations, an optimizer compile wrapped in a LossScaleOptimizer (the job
    passes plain Adam), and the global dtype policy float32 again after it."""
    cases = {n: c for n, c in report["cases"].items() if n.startswith("f16_")}
    assert len(cases) == 1, list(cases)
    for name, c in cases.items():
        assert c["policy"] == {"model": "mixed_float16", "boundaries": ["float16"],
                               "optimizer": "LossScaleOptimizer", "global_after": "float32"}, (name, c["policy"])


@on(*ALL_JOBS)
def test_other_cases_stay_float32(report):
    """Every case but the mixed_float16 one trains a float32 model and leaves the global
    policy float32 (on the 2-rank and ALL jobs: also after the mixed_float16 case)."""
    for name, c in report["cases"].items():
        if not name.startswith("f16_"):
            assert c["policy"]["model"] == "float32" and c["policy"]["global_after"] == "float32", (name, c["policy"])


@on(*ALL_JOBS)
def test_callbacks_see_serial_batch_ends(report):
    """on_train_batch_end: the batch indices and logs serial Keras gives, for every case."""
    for name, c in report["cases"].items():
        got = c["batch_ends"]
        assert got["batches"][0] == got["batches"][1], (name, got["batches"])
        assert got["keys_equal"] and got["logs_diff"] <= _tol(name)[0], (name, got)


@on(*LOSS_SCALE_JOBS)
def test_callbacks_see_serial_batch_ends_with_steps_per_execution(report):
    """The "lso" case compiles with steps_per_execution=3 (8 steps per epoch: calls after
    steps 3, 6 and 8, which Keras numbers 2, 5 and 8); its logs are checked above."""
    spe = {n: c["batch_ends"]["batches"] for n, c in report["cases"].items() if "_spe3_" in n}
    assert len(spe) == 1, list(spe)
    for name, batches in spe.items():
        assert batches[0] == batches[1] == [2, 5, 8], (name, batches)


@on(P2)
def test_predict_of_a_model_never_compiled_is_serial_predict(report):
    # Before: NotImplementedError "Cannot convert a symbolic tf.Tensor" (a traced step)
    found = report["predict_uncompiled"]
    assert "error" not in found and found["rows"] == 10, found
    assert found["diff"] <= TOL["mlp"][1], found


@on(P2)
def test_unseeded_shuffle_gives_stage_0_and_the_last_stage_the_same_batches(report):
    assert report["unseeded_shuffle"]["each_x_met_its_y"], report["unseeded_shuffle"]


@on(ALL4)
def test_replicas_average_batch_norm_statistics_so_every_rank_and_the_file_hold_one_model(report):
    # Each replica's moving statistics follow its own slices (jobs/_replica_stats.py): before the
    # averaging the trained model predicted 1.24 away from its own file reloaded.
    assert_one_model_across_replicas(report["batch_norm_replicas"])
