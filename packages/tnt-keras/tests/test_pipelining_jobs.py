"""Pipelining on real ranks (jobs/pipeline.py through the launcher) against serial Keras.

Three launches: PIPELINING on 2 and 3 ranks (one pipeline, one stage per rank) and ALL
on 4 ranks (two replicas of a 2-stage pipeline); fewer cannot cover p = 2 and 3 with N
ranks (PIPELINING needs N == p, ALL N % p == 0). The 2-rank job leaves its p = 2 file in
a directory the 3-rank job loads from (p = 2 -> q = 3). Tolerances are those of the
data-parallel tests (float32 summation order; docs/architecture.md, "The promise").
"""

from __future__ import annotations

import re

import pytest
from conftest import launch, print_diff_table

TOL = {"mlp": (1e-5, 2e-5), "skip": (1e-5, 2e-5), "cnn": (1e-4, 1e-3), "lso": (1e-5, 2e-5),  # (losses, weights)
       "emb": (1e-5, 2e-5),
       # mixed_float16: float16 rounds to 2^-11 relative, so an activation can round the other
       # way after a float32 difference of 1e-7; about 1 float16 ulp of values ~1
       "f16": (1e-3, 1e-3)}

#: The layers whose gradients overflow at a loss-scaled case's first step (checked on the
#: serial model): stage 0's alone ("lso", float32) or the last stage's alone ("f16").
OVERFLOW_AT_START = {"lso": ["l0"], "f16": ["l1"]}


#: Metric and loss-tracker variables a stage holds besides its weights and optimizer.
METRIC_BYTES = 64


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Where the 2-rank job leaves its p = 2 save for the 3-rank job."""
    return tmp_path_factory.mktemp("pipe_shared")


@pytest.fixture(scope="module", params=[(2, "pipelining"), (3, "pipelining"), (4, "all")],
                ids=lambda p: f"{p[1]}_{p[0]}ranks")
def report(request, tmp_path_factory, shared):
    ranks, layout = request.param
    out = tmp_path_factory.mktemp("pipe") / "pipeline.json"
    share = ["--shared", str(shared)] if ranks == 2 or (ranks == 3 and (shared / "p2.keras").exists()) else []
    result = launch(ranks, "pipeline.py", out, "--layout", layout, *share)
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


def _tol(name: str) -> tuple[float, float]:
    return TOL[name.split("_")[0]]


def test_history_evaluate_predict_and_weights_match_serial(report):
    for name, c in report["cases"].items():
        tol_loss, tol_w = _tol(name)
        assert c["history_diff"] <= tol_loss, (name, c["history_diff"])
        assert c["evaluate_diff"] <= tol_loss, (name, c["evaluate_diff"])
        assert c["weight_diff"] <= tol_w, (name, c["weight_diff"])
        assert c["predict_diff"] <= tol_w, (name, c["predict_diff"])
        assert c["predict_rows"] == [17, 17], name  # full output, in order, on every rank
        assert c["history_keys"] == ["accuracy", "loss", "val_accuracy", "val_loss"], name


def test_every_rank_sees_the_same_logs_and_predictions(report):
    assert all(c["same_logs_on_all_ranks"] for c in report["cases"].values())


def test_gpipe_and_1f1b_are_bitwise_identical(report):
    assert report["gpipe_equals_1f1b"] and all(report["gpipe_equals_1f1b"].values()), report["gpipe_equals_1f1b"]


def test_replicas_hold_bitwise_identical_stages(report):
    assert all(c["replicas_identical"] for c in report["cases"].values())


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


def test_1f1b_holds_at_most_min_p_minus_s_m_micro_batches(report):
    p = report["ranks"] if report["layout"] == "pipelining" else report["ranks"] // 2
    for name, c in report["cases"].items():
        m = int(re.search(r"_m(\d+)_", name).group(1))
        expected = [min(p - r % p, m) if name.endswith("1f1b") else m for r in range(report["ranks"])]
        assert c["peak_in_flight"] == expected, (name, c["peak_in_flight"])


def test_save_gathers_one_plain_keras_file_and_loads_into_any_stage_count(report):
    if report["ranks"] == 3:  # by design: the 2- and 4-rank jobs save and load (q = 2, 4)
        assert "save_load" not in report
        return
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


def test_validation_split_and_class_weight_match_serial(report):
    if report["ranks"] != 2:  # checked once, on the 2-rank job
        assert "validation_split_history_diff" not in report
        return
    assert report["validation_split_history_diff"] <= 1e-5


def test_file_saved_at_p2_loads_into_3_stages(report):
    if report["ranks"] != 3:
        return
    if "load_p2_file" not in report:  # only when the 3-rank job is selected alone (-k)
        pytest.skip("needs the file the 2-rank job saves; run both jobs (the module) together")
    got = report["load_p2_file"]
    assert got["stages"] == 3 and got["predict_diff"] <= 2e-5, got
    _assert_load_reads_only_the_stage(got["materialised_vs_stage_bytes"], "p2 -> q3")


def test_backup_and_restore_resume_equals_uninterrupted_serial(report):
    if report["ranks"] != 3:  # checked on the 3-stage job
        assert "backup_resume" not in report
        return
    got = report["backup_resume"]
    assert got["interrupted"] and got["resumed_epochs"] == 2, got
    assert got["history_diff"] <= 1e-5 and got["weight_diff"] <= 2e-5, got
    assert got["backup_removed"], got


def test_loss_scale_optimizer_skips_and_scales_as_serial_on_every_stage(report):
    """LossScaleOptimizer: one stage's overflow skips the step everywhere (History and
    weights are checked with the other cases); every rank ends with serial Keras' loss
    scale and number of applied steps. Stage 0 alone overflows first in the float32 case,
    the last stage alone in the mixed_float16 one: neither stage alone may decide."""
    cases = {n: c for n, c in report["cases"].items() if c["loss_scale"]}
    if report["ranks"] == 3:  # checked on 2 stages and ALL 2 x 2
        assert not cases
        return
    assert sorted(n.split("_")[0] for n in cases) == ["f16", "lso"], list(cases)
    for name, c in cases.items():
        ls = c["loss_scale"]
        # The case really overflows, at first on one stage only (the other alone must not
        # decide), and skips steps serially.
        assert ls["overflow_at_start"] == OVERFLOW_AT_START[name.split("_")[0]], (name, ls)
        scale, applied = ls["serial"]
        assert ls["steps"] - applied >= 3, (name, ls)
        assert all(r == [scale, applied] for r in ls["per_rank"]), (name, ls)


def test_mixed_float16_case_computes_in_float16_and_leaves_the_policy(report):
    """The mixed_float16 case is what it claims: a mixed_float16 model whose stages send
    float16 activations, an optimizer compile wrapped in a LossScaleOptimizer (the job
    passes plain Adam), and the global dtype policy float32 again after it (other cases
    are unaffected)."""
    cases = {n: c for n, c in report["cases"].items() if n.startswith("f16_")}
    assert len(cases) == (0 if report["ranks"] == 3 else 1), list(cases)
    for name, c in cases.items():
        assert c["policy"] == {"model": "mixed_float16", "boundaries": ["float16"],
                               "optimizer": "LossScaleOptimizer", "global_after": "float32"}, (name, c["policy"])
    for name, c in report["cases"].items():
        if not name.startswith("f16_"):
            assert c["policy"]["model"] == "float32" and c["policy"]["global_after"] == "float32", (name, c["policy"])


def test_callbacks_see_serial_batch_ends_also_with_steps_per_execution(report):
    """on_train_batch_end: the batch indices and logs serial Keras gives, for every case;
    the LossScaleOptimizer cases compile with steps_per_execution=3 (8 steps per epoch:
    calls after steps 3, 6 and 8, which Keras numbers 2, 5 and 8)."""
    spe_cases = 0
    for name, c in report["cases"].items():
        got = c["batch_ends"]
        assert got["batches"][0] == got["batches"][1], (name, got["batches"])
        assert got["keys_equal"] and got["logs_diff"] <= _tol(name)[0], (name, got)
        if "_spe3_" in name:
            spe_cases += 1
            assert got["batches"][0] == [2, 5, 8], (name, got["batches"])
    assert spe_cases == (0 if report["ranks"] == 3 else 1), spe_cases


def test_unseeded_shuffle_gives_stage_0_and_the_last_stage_the_same_batches(report):
    if report["ranks"] != 2:
        assert "unseeded_shuffle" not in report
        return
    assert report["unseeded_shuffle"]["each_x_met_its_y"], report["unseeded_shuffle"]
