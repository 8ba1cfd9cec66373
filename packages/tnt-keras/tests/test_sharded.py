"""Sharded data parallelism, ``tnt.Model(sharding=1|2|3)`` (docs/sharding.md), launched on 2 and
3 ranks (uneven byte shares) against serial Keras in the same job (jobs/sharded.py): History
and weights, identical replicas, optimizer slots only for owned variables, global_clipnorm
and a LossScaleOptimizer, a level-2 file saved at d = 2 read by serial Keras and resumed at
level 1, and the errors. Level 3 (parameters sharded): Adam with global_clipnorm (2 ranks) and
SGD momentum (3 ranks) against serial Keras with evaluate/predict and the elements each rank
stores; BatchNormalization, Dropout and a layer with its own seeded mask bitwise equal to level
2; its file read serially and resumed at level 3; *_on_batch after the level-3 fits; mixed_float16
with a LossScaleOptimizer skipping overflowing steps (2 ranks); a level-3 BackupAndRestore backup
written by the 2-rank launch resumed at level 3 by the 3-rank launch. A deferred build at level 3 (3 ranks):
each per-layer variable materialised on its owner only, initial values bitwise, 1 epoch vs serial. ParallelStrategy.ALL's replica axis: 2 pipeline stages x 2 replicas at
level 2 (Adam, global_clipnorm), its file resumed at level 1, and at level 3 (the stage's
weights gathered per step: bitwise level 2's, only owned weights stored between steps, evaluate,
predict, its file loaded at level 3), and 2 replicas of 2-rank tensor groups
(no stages) at level 3 (Adam, a vocab-split Embedding; level 2's step with the weights gathered per step:
only owned weights stored after fit), its file resumed at level 1, in the shared
4-rank launch; its error paths on one process. A model's own train_step at levels 1-3 (one
optimizer with global_clipnorm; a GAN's two optimizers, each sharded over its own variables)
against serial Keras, with each optimizer's slots per rank; at level 3 (the weights gathered
per step) also bitwise level 2's and only owned weights stored between steps."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from conftest import share

import tarantella as tnt
from tarantella.data_parallel import ShardingError, assign_owners

TOL_LOSS, TOL_WEIGHTS = 1e-5, 2e-5  # float32 summation order, as tests/test_exactness.py
# The cases each launch runs (suite time: two launches of a few fits each).
RUNS = {
    2: ["l2_adam_clip", "l1_lso_sgd", "l2_adam_seq", "l3_adam_clip", "files", "l3_files", "l3_vs_l2", "l3_mixed",
        "l3_shared_call", "errors", "own_l1_adam_clip", "own_l2_adam_clip", "own_l2_gan", "own_l3_adam_clip",
        "own_l3_gan"],
    3: ["l1_adam_clip", "l2_sgd_momentum", "l3_sgd_momentum", "l3_deferred", "l3_backup_resume"],
}
#: A model's own train_step (jobs/_sharded_own_step.py), 2 ranks (uneven byte shares): one optimizer
#: (Adam, global_clipnorm) at levels 1, 2 and 3; a GAN's two optimizers at levels 2 and 3. (On 3 ranks the
#: same cases pass too, run by hand: docs/sharding.md; left out for suite time.)
OWN_STEP_RUNS = {d: [n for n in cases if n.startswith("own_")] for d, cases in RUNS.items()}
NOT_CASES = ("files", "l3_files", "l3_vs_l2", "l3_shared_call", "l3_deferred", "l3_mixed", "l3_backup_resume", "errors",
             *OWN_STEP_RUNS[2], *OWN_STEP_RUNS[3])
SLOTS_PER_VARIABLE = {"sgd_momentum": 1, "lso_sgd": 1, "adam": 2, "adam_clip": 2, "adam_seq": 2}


_REPORTS: dict[int, dict] = {}
#: ALL, 2 stages x 2 replicas (jobs/sharded.py all_case), in the shared 4-rank launch. Level 1
#: trains there too: the level-2 file is loaded at level 1 and trained on (all_l1_adam, the
#: same from a fresh model, passes as well; left out for suite time).
ALL_RUN = ["all_l2_adam_clip", "all_l3_adam_clip"]  # Adam, global_clipnorm (active: test_global_clipnorm_was_active)
#: ALL, 2 replicas of 2-rank tensor groups without stages (jobs/sharded.py all_tensor_case).
#: Level 3 runs level 2's step (the reduce-scatter, the owners' update, the allgather of
#: values) with the weights gathered per step around it, so its case covers level 2's too;
#: all_tensor_l2_adam (SHA-256 equal to level 3's, by hand) is left out for suite time.
ALL_TENSOR_RUN = ["all_tensor_l3_adam"]


#: The 2-rank launch leaves its level-3 BackupAndRestore backup in the session's shared folder
#: for the 3-rank launch (l3_backup_resume): launches go in ascending rank count (shared_launch.py).
for _ranks, _cases in RUNS.items():  # in the shared launches (shared_launch.py)
    share(__name__, _ranks, "sharded", "sharded.py", "--only", ",".join(_cases), "--shared", "{shared}")
share(__name__, 4, "sharded_all", "sharded.py", "--only", ",".join(ALL_RUN + ALL_TENSOR_RUN))


def _report(ranks: int, shared_launches) -> dict:
    if ranks in _REPORTS:
        return _REPORTS[ranks]
    result = shared_launches.result(ranks, "sharded")
    assert result["ranks"] == ranks
    print(f"\nsharded DATA on {ranks} ranks (max abs difference to serial Keras)")
    for name, c in result["cases"].items():
        print(f"{name:16} history {c['history_diff']:.2e}  weights {c['weight_diff']:.2e}  "
              f"slots per rank {c['slot_elements_per_rank']} (serial {c['serial_slot_elements']})")
    _REPORTS[ranks] = result
    return result


@pytest.fixture(scope="module", params=sorted(RUNS))
def report(request, shared_launches):
    return _report(request.param, shared_launches)


@pytest.fixture(scope="module")
def report2(shared_launches):
    """The 2-rank launch: it also runs the file and error cases."""
    return _report(2, shared_launches)


def test_every_case_ran(report):
    wanted = [n for n in RUNS[report["ranks"]] if n not in NOT_CASES]
    assert sorted(report["cases"]) == sorted(wanted)


def test_history_and_weights_equal_serial_and_replicas_identical(report):
    for name, c in report["cases"].items():
        assert c["history_diff"] <= TOL_LOSS, (name, c)
        assert c["weight_diff"] <= TOL_WEIGHTS, (name, c)
        assert c["replicas_identical"], (name, c)


def test_each_replica_holds_only_its_owned_slots(report):
    d = report["ranks"]
    for name, c in report["cases"].items():
        per_var = SLOTS_PER_VARIABLE[name.split("_", 1)[1]]
        scalars = c["serial_slot_elements"] - per_var * c["variable_elements"]  # iterations, lr, scale
        slots = [s - scalars for s in c["slot_elements_per_rank"]]
        # The per-variable slots partition serial Keras' exactly, each replica holding a share.
        assert sum(slots) == per_var * c["variable_elements"], (name, c)
        assert all(0 < s < per_var * c["variable_elements"] for s in slots), (name, c)
        assert len(c["owned_per_rank"]) == d and all(n >= 1 for n in c["owned_per_rank"]), (name, c)
        assert sorted(c["bytes_per_rank"]) == sorted(4 * s // per_var for s in slots), (name, c)


#: Cases the job runs with TNT_FUSION_THRESHOLD=0.5 (KB): several buckets (jobs/sharded.py).
SMALL_BUCKETS = {"l2_adam_clip", "l1_lso_sgd", "l2_sgd_momentum", "all_l2_adam_clip", "all_l3_adam_clip",
                 "all_tensor_l2_adam", "all_tensor_l3_adam"}


def test_small_fusion_thresholds_cut_the_sharded_collectives_into_buckets(report):
    # The model's variables (832, 52, 364, 28, 84, 12 bytes) in buckets of <= 512 bytes: 3;
    # under the default 8 MiB one. The exactness checks above ran over both layouts. Level 3
    # gathers every variable of this model per layer: no bucket after the update.
    for name, c in report["cases"].items():
        expected = 0 if name.startswith("l3_") else 3 if name in SMALL_BUCKETS else 1
        assert c["buckets"] == expected, (name, c["buckets"])


def test_buckets_hold_consecutive_variables_up_to_the_limit():
    from tarantella._core.shard_buckets import cut_into_buckets

    assert cut_into_buckets([0, 1, 2, 3, 4, 5], [832, 52, 364, 28, 84, 12], 512) == [[0], [1, 2, 3], [4, 5]]
    assert cut_into_buckets([4, 7, 9], [10, 10, 10], 20) == [[4, 7], [9]]
    assert cut_into_buckets([1, 2], [5, 5], 0) == [[1], [2]]  # threshold 0: one variable each
    assert cut_into_buckets([], [], 8) == []
    with pytest.raises(ValueError, match="3 positions but 2 sizes"):
        cut_into_buckets([0, 1, 2], [1, 2])


def test_level_2_reduce_scatters_start_during_backprop(report):
    # Note [Reduce-scatter during backprop]: in the traced step, the first reduce-scatter waits
    # for no wait of the fused allreduce (batch size and metric states, computed last) and has
    # no control input; the others follow it in one chain (the same order on every replica).
    # Before, each waited for the fused allreduce: first_after_fused_wait was True.
    seen = 0
    for name, c in report["cases"].items():
        if not name.startswith("l2_"):
            continue
        g, expected = c["scatter_graph"], 3 if name in SMALL_BUCKETS else 1
        assert g["count"] == expected and g["first_count"] == 1, (name, g)
        assert not g["first_after_fused_wait"] and g["first_control_inputs"] == 0, (name, g)
        assert g["scatters_before_each"] == list(range(expected)), (name, g)
        seen += 1
    assert seen >= 1, sorted(report["cases"])


def test_level_2_updates_wait_for_their_release_bucket(report):
    # Note [Level 2's updates released in step]: in the traced step, each owned sum reaches its
    # update through an identity waiting for exactly the reduce-scatters up to its planned release
    # bucket (release_buckets, checked by hand above). On 3 ranks (l2_sgd_momentum, 3 buckets)
    # some update waits for a later bucket than its own; without the gate each waited for its
    # own bucket only (waits == own bucket).
    checked = lagged = 0
    for name, c in report["cases"].items():
        if not name.startswith("l2_") or "scatter_graph" not in c:
            continue
        for per_rank in c["scatter_graph"]["releases"]:
            for i, (waits, planned, own) in per_rank.items():
                assert waits == planned >= own, (name, i, waits, planned, own)
                checked += 1
                lagged += planned > own
    assert checked >= 1, sorted(report["cases"])
    if report["ranks"] == 3:
        assert lagged >= 1, sorted(report["cases"])


def test_level_2_updates_one_variable_at_a_time_and_gathers_bucket_by_bucket(report):
    # Note [Level 2's update bucket by bucket]: in each traced global step, every owned
    # variable's writes wait for the previous one's, and the first allgather of values waits
    # for the writes of the first bucket's owned variables only (so the chain runs in bucket
    # order). Before, the updates were unchained: chained 0 on the 3-rank l2_sgd_momentum's
    # rank owning 4 variables (run with the chain removed).
    chains = later = 0  # ranks whose check could fail: several owned variables; some past bucket 1
    for name, c in report["cases"].items():
        if not name.startswith("l2_"):
            continue
        for g in (g for per_rank in c["update_graph"] for g in per_rank):
            assert g["written"] == g["owned"] >= 1, (name, g)
            assert g["chained"] == g["owned"] - 1, (name, g)
            chains += g["owned"] >= 2
            if not g["early"]:  # updates after every sum: in the values' bucket order
                assert g["before_first_gather"] == g["first_bucket"], (name, g)
                later += g["owned"] > len(g["first_bucket"])
    assert chains >= 1, sorted(report["cases"])
    if report["ranks"] == 2:  # l2_adam_clip's 3 buckets (global_clipnorm: after every sum)
        assert later >= 1, sorted(report["cases"])


def test_level_2_updates_run_during_backprop_and_gathers_one_bucket_at_a_time(report):
    # Note [Level 2's update during backprop]: without global_clipnorm or a loss scale, no owned
    # variable's writes wait for the global part's ``after`` inputs (the last reduce-scatter's
    # token); with global_clipnorm (l2_adam_clip) every one does. Before, all did (measured:
    # the level-2 step's peak stood at the end of backprop, docs/sharding.md). And each
    # allgather of values waits for the previous bucket's writes of received values (before:
    # none did, so a rank held every received bucket to the step's end).
    early = late = gather_pairs = 0
    for name, c in report["cases"].items():
        if not name.startswith("l2_"):
            continue
        for g in (g for per_rank in c["update_graph"] for g in per_rank):
            assert g["after_inputs"] >= 1, (name, g)
            assert g["early"] == ("clip" not in name), (name, g)
            assert g["writes_after_last_scatter"] == (0 if g["early"] else g["owned"]), (name, g)
            early += g["early"]
            late += not g["early"]
            done, pairs = g["gathers_after_received_writes"]
            assert done == pairs, (name, g)
            gather_pairs += pairs
    assert early >= 1 and (late >= 1 or report["ranks"] == 3), sorted(report["cases"])
    assert gather_pairs >= 1, sorted(report["cases"])


def test_level_2_scatter_buckets_go_in_backprop_order_large_first():
    import types

    from tarantella.data_parallel._sharding import Sharding

    # Variables of 832, 52, 364, 28, 84, 12 bytes; owners 0, 1, 1, 1, 1, 1 (largest first).
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(13), keras.layers.Dense(7), keras.layers.Dense(3)])
    shards = Sharding(model, 2, comm=types.SimpleNamespace(rank=0, size=2), bucket_bytes=512)
    assert shards.owners == [0, 1, 1, 1, 1, 1]
    # Cut from the last variable back: [5, 4, 3, 2] (488 B), [1] (52 B), [0] (832 B); each laid
    # out by (owner, index); those of >= 256 B first, then [1].
    assert [idx for _, idx in shards.scatter_buckets(range(6))] == [[2, 3, 4, 5], [0], [1]]


def test_level_2_updates_are_released_where_every_replica_has_as_much_to_update():
    from tarantella.data_parallel._update_release import release_buckets

    # Note [Level 2's updates released in step]. Five equal kernels in wire order, owned
    # 0, 1, 0, 1, 0 (as largest-first ownership alternates), then one bucket of biases.
    buckets, owners = [[0], [1], [2], [3], [4], [5, 6]], [0, 1, 0, 1, 0, 0, 1]
    sizes = [100, 100, 100, 100, 100, 1, 1]
    # Replica 0's kernel 0 waits for replica 1's kernel 1 (bucket 1), so both update in the same
    # interval; kernel 2 pairs with kernel 3; kernel 4 has no partner: after the last bucket.
    # (Released at its own bucket, replica 1 would wait for each of them at the next scatter.)
    assert release_buckets(buckets, owners, sizes, 2) == {0: 1, 1: 1, 2: 3, 3: 3, 4: 5, 5: 5, 6: 5}
    # One replica owning everything before the other owns anything: nothing is released early.
    assert release_buckets([[0], [1], [2]], [0, 0, 1], [10, 10, 20], 2) == {0: 2, 1: 2, 2: 2}
    # Three replicas: a release needs all three to have had as much arrive.
    assert release_buckets([[0], [1], [2], [3]], [0, 1, 2, 0], [5, 5, 5, 5], 3) == {0: 2, 1: 2, 2: 2, 3: 3}
    assert release_buckets([], [], [], 2) == {}


def test_global_clipnorm_was_active(report):
    for name, c in report["cases"].items():
        if "clip" in name:
            assert c["initial_gradient_norm"] > 0.05 * 2, c  # the threshold clips


def test_loss_scale_decision_is_global(report):
    for name, c in report["cases"].items():
        applied, serial_applied = c["applied_steps"]
        assert applied == serial_applied, (name, c)  # skipped exactly where serial Keras skipped
        if "lso" in name:  # the case overflows in some steps and not in others
            assert 0 < serial_applied < c["steps"], (name, c)


def test_file_of_level_2_loads_serially_and_resumes_at_level_1(report2):
    f = report2["files"]
    assert f["loaded_weight_diff"] <= TOL_WEIGHTS, f
    count, serial_count = f["loaded_optimizer_count"]
    assert count == serial_count, f
    assert f["loaded_optimizer_diff"] <= TOL_WEIGHTS, f
    assert f["backup_weight_diff"] <= TOL_WEIGHTS, f  # BackupAndRestore writes the whole state too
    assert f["backup_optimizer_diff"] <= TOL_WEIGHTS, f
    assert f["resumed_weight_diff"] <= TOL_WEIGHTS, f
    assert f["resumed_replicas_identical"], f
    assert len(f["resumed_slot_elements_per_rank"]) == 2, f


def test_errors_name_the_option(report2):
    errors = report2["errors"]
    assert sorted(errors) == ["bad_level", "level_3_read_outside_a_step",
                              "level_3_sync_batch_norm", "optimizer_not_per_variable", "other_strategy",
                              "own_step_optimizer_on_other_variables"]
    for name, e in errors.items():
        assert e["ok"], (name, e["detail"])


def test_own_train_step_cases_ran(report2):
    assert sorted(report2.get("own_step", {})) == sorted(OWN_STEP_RUNS[2])
    for name, c in report2["own_step"].items():
        print(f"{name:18} history {c['history_diff']:.2e}  weights {c['weight_diff']:.2e}  slots per rank "
              + "  ".join(f"{k} {o['slot_elements_per_rank']} (serial {o['serial_slot_elements']})"
                          for k, o in c["optimizers"].items()))


def test_own_train_step_equals_serial_with_identical_replicas(report2):
    # History (every key the step returns: the GAN's d_loss and g_loss) and weights against
    # serial Keras running the same class; replicas SHA-256 alike after the allgather.
    for name, c in report2["own_step"].items():
        assert c["history_keys"] == (["d_loss", "g_loss"] if name.endswith("gan") else ["loss"]), (name, c)
        assert c["history_diff"] <= TOL_LOSS, (name, c)
        assert c["weight_diff"] <= TOL_WEIGHTS, (name, c)
        assert c["replicas_identical"], (name, c)
        if "clip" in name:
            assert c["initial_gradient_norm"] > 0.05 * 2, c  # global_clipnorm=0.05 clips


def test_own_train_step_save_writes_every_optimizer_whole_and_load_weights_reads_it_back(report2):
    # The GAN's file against serial Keras' file of the same training: the same arrays (the
    # compiled, d_ and g_ optimizers' whole state; before: only the master's owned slots of
    # d_/g_optimizer, 19 of 26 arrays), then load_weights into the zeroed sharded slots.
    gans = {n: c for n, c in report2["own_step"].items() if n.endswith("gan")}
    assert gans, report2["own_step"].keys()
    for name, c in gans.items():
        assert c["file_same_entries"], (name, c)
        assert c["file_optimizer_entries"] == 2 + 10 + 6, (name, c)  # Keras: optimizer 2, Adam 2+8, SGD 2+4
        assert c["file_diff"] <= TOL_WEIGHTS, (name, c)
        assert c["reloaded_slots_diff"] == 0.0, (name, c)


def test_own_train_step_each_optimizer_holds_only_its_owned_slots(report2):
    # Adam: 2 slots per element, SGD momentum 1; plus iterations and the learning rate.
    per_var = {"opt": 2, "d": 2, "g": 1}
    for name, c in report2["own_step"].items():
        assert sorted(c["optimizers"]) == (["d", "g"] if name.endswith("gan") else ["opt"]), (name, c)
        for key, o in c["optimizers"].items():
            whole = per_var[key] * o["variable_elements"]
            assert o["serial_slot_elements"] == whole + 2, (name, key, o)
            slots = [s - 2 for s in o["slot_elements_per_rank"]]
            assert len(slots) == report2["ranks"] and sum(slots) == whole, (name, key, o)
            assert all(0 < s < whole for s in slots), (name, key, o)
            assert o["applied_steps"] == [c["steps"]] * 2, (name, key, o)


def test_own_train_step_at_level_3_stores_only_owned_weights_and_equals_level_2_bitwise(report2):
    # Level 3 of an own train_step gathers the weights per step and runs level 2's step: the
    # same History and weights bit for bit (SHA-256 of get_weights() in the same launch).
    # Between steps (after every step of the fit, read from the buffers) and after the fit,
    # each rank stores exactly the trainable elements it owns; a read outside a step names the fix.
    own = report2["own_step"]
    for name in ("own_l3_adam_clip", "own_l3_gan"):
        c = own[name]
        print(f"{name}: stored elements per rank [largest after a step, after fit] {c['stored_elements_per_rank']}"
              f", owned {c['owned_elements_per_rank']} of {c['variable_elements']}")
        assert c["digest"] == own[name.replace("l3", "l2")]["digest"], name
        for stored, owned in zip(c["stored_elements_per_rank"], c["owned_elements_per_rank"]):
            assert stored == [owned, owned], (name, c)
        assert sum(c["owned_elements_per_rank"]) == c["variable_elements"], (name, c)
        assert max(c["owned_elements_per_rank"]) < c["variable_elements"], (name, c)
        read = c["read_outside_a_step"]
        assert read.startswith("ShardingError") and "get_weights()" in read and "sharding<=2" in read, read
    assert own["own_l3_adam_clip"]["predict_diff"] <= TOL_WEIGHTS, own["own_l3_adam_clip"]


def test_level_3_stores_only_owned_weights_and_evaluates_and_predicts_as_serial(report):
    l3 = {n: c for n, c in report["cases"].items() if n.startswith("l3_")}
    assert l3, report["cases"].keys()
    for name, c in l3.items():
        # Each rank stores exactly the trainable elements it owns; together, the model once.
        assert c["stored_elements_per_rank"] == c["owned_elements_per_rank"], (name, c)
        assert sum(c["stored_elements_per_rank"]) == c["variable_elements"], (name, c)
        assert max(c["stored_elements_per_rank"]) < c["variable_elements"], (name, c)
        assert c["evaluate_diff"] <= TOL_LOSS, (name, c)
        assert c["predict_diff"] <= TOL_WEIGHTS, (name, c)


def test_level_3_prefetches_one_layer_ahead_while_the_current_one_computes(report):
    # jobs/sharded.py prefetch_structure, from the traced step's graph (3 Dense layers): the
    # first gather of each direction starts when needed, every later one is started right
    # after the previous layer's wait, before that layer's MatMuls (overlapped), and waited
    # for only after them (bounded: at most 2 gathered layers at once). Fails if the compute
    # does not wait for the start (no overlap) or the wait not for the compute (unbounded).
    layers = 3
    for name, c in report["cases"].items():
        if not name.startswith("l3_"):
            continue
        assert c["prefetch"], (name, c)
        for traced in c["prefetch"]:
            assert traced == {"waits": 2 * layers, "starts": 2, "prefetches": 2 * (layers - 1),
                              "overlapped": 2 * (layers - 1), "bounded": 2 * (layers - 1)}, (name, traced)


def test_level_3_wrong_prefetch_guesses_cost_no_value(report2):
    # A Dense called twice: the first trace guesses each layer once (the plan's order), so 2
    # forward prefetches fetch the wrong layer; each is waited for and dropped by the next
    # call (so no compute precedes its wait: not "bounded"), and that call gathers its own.
    # Training still equals serial Keras; the call order is recorded for later traces.
    c = report2["l3_shared_call"]
    assert c["history_diff"] <= TOL_LOSS and c["weight_diff"] <= TOL_WEIGHTS, c
    assert c["predict_diff"] <= TOL_WEIGHTS, c
    assert c["order"] == ["twice", "twice", "mid", "head"], c
    calls = len(c["order"])
    for traced in c["prefetch"]:
        assert traced["prefetches"] - traced["bounded"] == 2, c  # the two dropped guesses
        assert traced["waits"] == 2 * calls + 2 and traced["prefetches"] == traced["overlapped"], c


def test_level_3_on_batch_equals_serial(report):
    # After the level-3 fit: train_on_batch twice (10 and 6 rows), test_on_batch, predict_on_batch.
    for name, c in report["cases"].items():
        if not name.startswith("l3_"):
            continue
        assert len(c["train_on_batch_diff"]) == 2 and max(c["train_on_batch_diff"]) <= TOL_LOSS, (name, c)
        assert c["test_on_batch_diff"] <= TOL_LOSS, (name, c)
        assert c["predict_on_batch_diff"] <= TOL_WEIGHTS, (name, c)
        assert c["on_batch_weight_diff"] <= TOL_WEIGHTS, (name, c)
        assert c["on_batch_applied_steps"] == [c["steps"] + 2] * 2, (name, c)


#: float16 compute: a rank's float16 gradient part against serial Keras' float16 gradient of the
#: whole batch differs by float16 rounding (eps 9.8e-4), not float32's (as jobs/api.py's mixed case).
TOL_MIXED_LOSS, TOL_MIXED_WEIGHTS = 2e-3, 5e-4


def test_level_3_under_mixed_float16_with_loss_scaling_equals_serial(report2):
    c = report2["l3_mixed"]
    assert c["compute_dtype"] == "float16", c
    applied, serial_applied = c["applied_steps"]
    # Some steps overflow float16 and are skipped, others applied: the decision is global.
    assert applied == serial_applied and 0 < serial_applied < c["steps"], c
    assert c["loss_scale"][0] == c["loss_scale"][1], c
    assert c["history_diff"] <= TOL_MIXED_LOSS, c
    assert c["weight_diff"] <= TOL_MIXED_WEIGHTS, c
    assert c["replicas_identical"], c
    assert sum(c["stored_elements_per_rank"]) == 343 and max(c["stored_elements_per_rank"]) < 343, c


def test_level_3_backup_written_on_2_ranks_resumes_on_3_ranks_as_serial(shared_launches):
    # l3_files (2 ranks, level 3, one epoch) kept its BackupAndRestore backup; the 3-rank launch
    # resumes it at level 3: only the second epoch runs, and it ends where serial Keras does.
    c = _report(3, shared_launches)["l3_backup_resume"]
    assert "missing" not in c, c
    assert c["resumed_epochs"] == [1] and c["iterations"] == 10, c
    assert c["history_diff"] <= TOL_LOSS, c
    assert c["weight_diff"] <= TOL_WEIGHTS, c
    assert c["stored_elements_per_rank"] == [208, 91, 44], c  # as l3_sgd_momentum's owners on 3 ranks


def test_level_3_with_batch_norm_dropout_and_a_seeded_layer_equals_level_2_bitwise(report2):
    # The same collectives' sums in the same order, and the recomputed forward draws the
    # forward's masks: nothing may differ (a recompute with a fresh seed state would).
    c = report2["l3_vs_l2"]
    assert c["per_layer_positions"] == list(range(8)), c  # every trainable variable, BN's too
    assert c["weights"] == 10, c  # with BN's moving statistics
    for key in ("history_diff", "weight_diff", "predict_diff"):
        assert c[key] == 0.0, (key, c)


def test_level_3_file_loads_serially_and_resumes_at_level_3(report2):
    f = report2["l3_files"]
    assert f["loaded_weight_diff"] <= TOL_WEIGHTS, f
    count, serial_count = f["loaded_optimizer_count"]
    assert count == serial_count, f
    assert f["loaded_optimizer_diff"] <= TOL_WEIGHTS, f
    assert f["resumed_weight_diff"] <= TOL_WEIGHTS, f
    assert sum(f["resumed_stored_elements_per_rank"]) == 343, f  # the model once over the ranks


def test_level_3_of_a_deferred_build_materialises_only_what_each_replica_stores(shared_launches):
    # jobs/sharded.py deferred_model on 3 ranks: Dense(13) 16x13 + 13, Dense(7) with an L2
    # kernel regularizer 13x7 + 7 (kept whole: Keras reads it outside the call), Dense(3) 7x3 + 3.
    c = _report(3, shared_launches)["l3_deferred"]
    per_layer, whole = {0: 208, 1: 13, 4: 21, 5: 3}, {2: 91, 3: 7}
    made = c["materialised_per_rank"]
    assert c["variables"] == 6 and len(made) == 3, c
    # Every per-layer variable got memory on exactly one rank, never on the others (not even
    # transiently while wrapping or training); every whole one on each rank.
    for i in per_layer:
        assert sum(i in m for m in made) == 1, (i, c)
    for i in whole:
        assert all(i in m for m in made), (i, c)
    assert sum(c["materialised_elements_per_rank"]) == sum(per_layer.values()) + 3 * sum(whole.values()), c
    assert c["materialised_elements_per_rank"] == c["stored_elements_per_rank"], c
    assert all(c["initial_bitwise_equal_per_rank"]), c  # the eager build's initial values
    assert c["history_diff"] <= TOL_LOSS, c
    assert c["weight_diff"] <= TOL_WEIGHTS, c


def test_a_deferred_build_on_one_rank_trains_as_the_eager_build():
    """Levels 0-2 (and one rank, where every level is plain Keras) materialise a deferred
    model whole, from its initializers: the eager build's values and training."""
    def build():
        keras.utils.set_random_seed(5)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])

    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    eager = build()
    with tnt.deferred_variables():
        deferred = build()
    tm = tnt.Model(deferred, sharding=2)
    for a, b in zip(tm.get_weights(), eager.get_weights()):
        assert np.array_equal(a, b)
    for m in (tm, eager):
        m.compile(keras.optimizers.SGD(0.1), "mse")
        m.fit(x, x[:, :2], batch_size=4, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(tm.get_weights(), eager.get_weights()):
        assert np.array_equal(a, b)


def test_level_3_comm_worker_runs_in_submission_order_and_hands_back_errors():
    # Level 3's collectives run on one worker thread per replica (data_parallel/_prefetch.py):
    # the replicas agree on the order only if it is the submission order. The first job holds
    # the worker until another job starts (or 0.5 s pass): a worker running two at once, or
    # out of order, lets a later job start while it waits, and the order check fails.
    import threading

    from tarantella.data_parallel._prefetch import CommWorker, predict_next

    worker, ran, started = CommWorker(), [], []
    changed = threading.Condition()

    def job(k: int) -> int:
        with changed:
            started.append(k)
            changed.notify_all()
            if k == 0:
                changed.wait_for(lambda: len(started) > 1, timeout=0.5)
            ran.append(k)
        return k * k

    keys = [worker.submit(job, k) for k in range(8)]
    assert worker.call(lambda: list(ran)) == list(range(8))  # after every earlier submission
    assert [worker.result(key) for key in reversed(keys)] == [k * k for k in reversed(range(8))]

    def fails() -> None:
        raise RuntimeError("collective failed")

    key = worker.submit(fails)
    with pytest.raises(RuntimeError, match="collective failed"):
        worker.result(key)
    assert worker.call(job, 7) == 49  # the worker lives on after an error
    # Forward calls are predicted in order, backprop's in reverse; none past either end.
    assert [predict_next("abc", c, backward=False) for c in range(3)] == [1, 2, None]
    assert [predict_next("abc", c, backward=True) for c in range(3)] == [None, 0, 1]


def test_assignment_is_a_balanced_pure_function():
    sizes = [4096, 64, 4096, 64, 1024, 16, 1024, 16, 256, 4]
    for d in (1, 2, 3, 4):
        owners = assign_owners(sizes, d)
        assert owners == assign_owners(list(sizes), d)  # no state: the same on every rank
        loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(d)]
        assert sum(loads) == sum(sizes) and set(owners) == set(range(d))
        # Largest-first onto the least loaded: no replica exceeds the mean by more than the largest variable.
        assert max(loads) <= sum(sizes) / d + max(sizes)
    # Worked by hand: 4096 -> 0, 4096 -> 1, 1024 -> 0, 1024 -> 1, 256 -> 0, then the rest to 1.
    assert assign_owners(sizes, 2) == [0, 1, 1, 1, 0, 1, 1, 1, 0, 1]


# -- ALL: 2 pipeline stages x 2 replicas on 4 ranks ----------------------------------------------
@pytest.fixture(scope="module")
def report_all(shared_launches) -> dict:
    result = shared_launches.result(4, "sharded_all")
    assert result["ranks"] == 4
    print("\nsharded ALL 2 stages x 2 replicas (max abs difference to serial Keras)")
    for name, c in result["all"].items():
        print(f"{name:12} history {c['history_diff']:.2e}  weights {c['weight_diff']:.2e}  "
              f"optimizer bytes per rank {c['optimizer_bytes_per_rank']}")
    return result["all"]


def _by_stage(pairs) -> dict[int, list]:
    out: dict[int, list] = {}
    for stage, value, *rest in pairs:
        out.setdefault(stage, []).append(rest[0] if rest else value)
    return out


def test_all_cases_ran_pipelined(report_all):
    assert sorted(report_all) == sorted(ALL_RUN)
    assert all(c["strategy"] == "PipelinedModel" for c in report_all.values())


def test_all_replicas_gather_in_buckets(report_all):
    # TNT_FUSION_THRESHOLD=0.5 KB: stage 0 (Dense 16->13: 832 + 52 bytes) in 2 buckets, stage 1
    # (Dense 13->7, 7->3: 364, 28, 84, 12 bytes) in 1 — every rank of both replicas alike.
    for name, c in report_all.items():
        assert name in SMALL_BUCKETS
        assert sorted(c["buckets_per_rank"]) == [1, 1, 2, 2], (name, c["buckets_per_rank"])


def test_all_history_and_weights_equal_serial(report_all):
    for name, c in report_all.items():
        assert c["history_diff"] <= TOL_LOSS, (name, c)
        assert c["weight_diff"] <= TOL_WEIGHTS, (name, c)
        applied, serial_applied = c["applied_steps"]
        assert applied == serial_applied, (name, c)


def test_all_replicas_of_a_stage_are_bitwise_identical(report_all):
    for name, c in report_all.items():
        digests = _by_stage(c["stage_digests"])  # stage -> digests of its replicas
        assert sorted(digests) == [0, 1], (name, c)
        for stage, ds in digests.items():
            assert len(ds) == 2 and len(set(ds)) == 1, (name, stage, ds)


def _assert_slots_partition(name: str, c: dict, slot_pairs) -> None:
    scalars = c["serial_slot_elements"] - 2 * c["variable_elements"]  # Adam: 2 slots; iterations, lr
    elements = dict(c["stage_variable_elements"])
    for stage, slots in _by_stage(slot_pairs).items():
        per_var = [s - scalars for s in slots]
        # The replicas' Adam slots partition the stage's (serial Keras' for its variables).
        assert sum(per_var) == 2 * elements[stage], (name, stage, slots)
        assert len(per_var) == 2 and all(0 < s < 2 * elements[stage] for s in per_var), (name, stage, slots)


def test_all_each_replica_holds_only_its_owned_slots(report_all):
    for name, c in report_all.items():
        _assert_slots_partition(name, c, c["slot_elements_per_rank"])
        assert all(n >= 1 for n in c["owned_per_rank"]), (name, c)


def test_all_saved_file_is_serial_keras_with_the_whole_optimizer_state(report_all):
    for name, c in report_all.items():
        assert c["loaded_weight_diff"] <= TOL_WEIGHTS, (name, c)
        count, serial_count = c["loaded_optimizer_count"]
        assert count == serial_count, (name, c)
        assert c["loaded_optimizer_diff"] <= TOL_WEIGHTS, (name, c)


def test_all_level_2_file_loads_at_level_1_and_trains_on_as_serial(report_all):
    c = report_all["all_l2_adam_clip"]
    assert c["resumed_weight_diff"] <= TOL_WEIGHTS, c
    for stage, ds in _by_stage(c["resumed_stage_digests"]).items():
        assert len(ds) == 2 and len(set(ds)) == 1, (stage, ds)
    _assert_slots_partition("resumed", c, c["resumed_slot_elements_per_rank"])


def test_all_level_3_equals_level_2_bitwise(report_all):
    # Level 3 gathers before the schedule what level 2 gathers after the update: the same
    # owners' values, the same reduce-scattered sums (a gather of stale or zero values, or a
    # replica reading its freed copy, would differ).
    assert report_all["all_l3_adam_clip"]["weights_digest"] == report_all["all_l2_adam_clip"]["weights_digest"]


def test_all_level_3_stores_only_owned_weights_between_steps(report_all):
    c = report_all["all_l3_adam_clip"]
    elements = dict(c["stage_variable_elements"])
    for key in ("stored_per_rank", "loaded_stored_per_rank"):
        for stage, rows in _by_stage([(s, (stored, owned)) for s, stored, owned in c[key]]).items():
            # Read from the buffers: each replica holds exactly what it owns, the stage once.
            assert all(stored == owned for stored, owned in rows), (key, stage, rows)
            assert sum(stored for stored, _ in rows) == elements[stage], (key, stage, rows)
            assert all(0 < stored < elements[stage] for stored, _ in rows), (key, stage, rows)
    _assert_slots_partition("loaded at level 3", c, c["loaded_slot_elements_per_rank"])


def test_all_level_3_evaluates_predicts_and_loads_as_serial(report_all):
    c = report_all["all_l3_adam_clip"]
    assert c["evaluate_diff"] <= TOL_LOSS, c
    assert c["predict_diff"] <= TOL_WEIGHTS, c
    assert c["loaded_evaluate_diff"] <= TOL_LOSS, c  # the file at level 3: synchronised, freed, gathered


def test_all_level_3_read_outside_a_step_names_the_fix(report_all):
    read = report_all["all_l3_adam_clip"]["read_outside_a_step"]
    for needle in ("ShardingError", "sharding=3", "get_weights()", "save()", "sharding<=2"):
        assert needle in read, read


# -- ALL: 2 replicas of 2-rank tensor groups (one stage) on 4 ranks --------------------------------
@pytest.fixture(scope="module")
def report_tensor(shared_launches) -> dict:
    result = shared_launches.result(4, "sharded_all")
    print("\nsharded ALL 2 replicas x tensor groups of 2 (max abs difference to serial Keras)")
    for name, c in result["all_tensor"].items():
        print(f"{name:18} history {c['history_diff']:.2e}  weights {c['weight_diff']:.2e}  optimizer bytes "
              f"per rank {c['optimizer_bytes_per_rank']}  {c['seconds']:.1f} s")
    return result["all_tensor"]


def _by_shard(rows) -> dict[int, list]:
    """(shard, *rest) of every rank -> {shard: [rest of each of its replicas]}."""
    out: dict[int, list] = {}
    for shard, *rest in rows:
        out.setdefault(shard, []).append(rest[0] if len(rest) == 1 else tuple(rest))
    return out


def test_tensor_replicas_case_ran_on_tensor_groups(report_tensor):
    assert sorted(report_tensor) == sorted(ALL_TENSOR_RUN)
    for name, c in report_tensor.items():
        assert c["strategy"] == "TensorParallelModel", (name, c)
        assert c["plan"] == {"t_emb": "vocab", "t_up": "column", "t_down": "row", "t_ln": "replicated",
                             "t_head": "replicated"}, (name, c)


def test_tensor_replicas_gather_in_buckets(report_tensor):
    for name, c in report_tensor.items():
        assert name in SMALL_BUCKETS
        assert c["buckets"] >= 2, (name, c["buckets"])  # TNT_FUSION_THRESHOLD=0.5 KB


def test_tensor_replicas_history_and_weights_equal_serial(report_tensor):
    for name, c in report_tensor.items():
        assert c["history_diff"] <= TOL_LOSS, (name, c)
        assert c["weight_diff"] <= TOL_WEIGHTS, (name, c)
        applied, serial_applied = c["applied_steps"]
        assert applied == serial_applied == 5, (name, c)


def test_tensor_replicas_of_a_shard_are_bitwise_identical(report_tensor):
    for name, c in report_tensor.items():
        for key in ("digests", "reloaded_digests"):
            # (replica, shard SHA-256, replicated SHA-256) of each shard's replicas
            by_shard = _by_shard(c[key])
            assert sorted(by_shard) == [0, 1], (name, key)
            for shard, rows in by_shard.items():
                assert sorted(r[0] for r in rows) == [0, 1], (name, key, shard, rows)
                assert len({r[1:] for r in rows}) == 1, (name, key, shard, rows)
            assert by_shard[0][0][1] != by_shard[1][0][1], (name, key)  # the two shards differ


def test_tensor_replicas_partition_each_shards_variables_and_slots(report_tensor):
    for name, c in report_tensor.items():
        scalars = c["serial_slot_elements"] - 2 * c["serial_variable_elements"]  # Adam: iterations, lr
        paths = _by_shard(zip([s for s, *_ in c["slots_per_rank"]], c["trainable_paths"]))
        owned = _by_shard(zip([s for s, *_ in c["slots_per_rank"]], c["owned_paths"]))
        for key in ("slots_per_rank", "reloaded_slots_per_rank"):
            for shard, rows in _by_shard(c[key]).items():
                held = [slots - scalars for slots, _ in rows]
                local = rows[0][1]
                # The replicas' Adam slots partition the shard's local model's (2 per element).
                assert sum(held) == 2 * local and all(0 < h < 2 * local for h in held), (name, key, shard, rows)
        for shard, (mine, theirs) in owned.items():
            # Every variable of the shard, split or replicated, has exactly one owner.
            assert not set(mine) & set(theirs) and sorted(mine + theirs) == paths[shard][0], (name, shard)
            assert any("t_ln" in p for p in paths[shard][0]) and any("t_head" in p for p in paths[shard][0])
            # One replica owns the (sparse) table alone: it receives no dense gradient at level 2.
            assert ["t_emb/embeddings"] in (mine, theirs), (name, shard, mine, theirs)


def test_tensor_replicas_file_is_serial_keras_and_loads_at_level_1(report_tensor):
    for name, c in report_tensor.items():
        assert c["loaded_weight_diff"] <= TOL_WEIGHTS, (name, c)
        count, serial_count = c["loaded_optimizer_count"]
        assert count == serial_count, (name, c)
        assert c["loaded_optimizer_diff"] <= TOL_WEIGHTS, (name, c)
        # tnt.models.load_model(..., sharding=1) into the same layout: what each rank held.
        assert c["reloaded_weight_diff"] == 0.0, (name, c)
        assert c["reloaded_slots_diff"] == [0.0] * 4, (name, c)


def test_tensor_replicas_at_level_3_store_only_owned_weights(report_tensor):
    # Level 3 gathers each shard's weights in its replica group per step. After fit each
    # rank's buffers hold exactly the trainable elements it owns (read from the buffers), the
    # shard's once over its replicas; a read outside a step names the fix.
    l3 = report_tensor["all_tensor_l3_adam"]
    local = dict((shard, elements) for shard, _, elements in l3["slots_per_rank"])
    for shard, rows in _by_shard(l3["stored_per_rank"]).items():
        print(f"all_tensor_l3_adam shard {shard}: stored elements per replica (stored, owned) {rows} of {local[shard]}")
        assert all(stored == owned for stored, owned in rows), (shard, rows)
        assert sum(stored for stored, _ in rows) == local[shard], (shard, rows)
        assert all(0 < stored < local[shard] for stored, _ in rows), (shard, rows)
    read = l3["read_outside_a_step"]
    assert read.startswith("ShardingError") and "get_weights()" in read and "sharding<=2" in read, read


# -- ALL: error paths on one process ---------------------------------------------------------------
def _mlp() -> keras.Model:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])


def test_all_level_3_passes_to_replicas_and_is_refused_with_stages_of_tensor_groups():
    """Level 3 runs on replicas of pipelines, of tensor groups (and of whole models); pipeline
    stages of tensor groups name levels 1 and 2."""
    from tarantella.hybrid._strategy import _sharding_level

    assert _sharding_level({"sharding": 3}) == 3
    assert _sharding_level({"sharding": 3}, tensor_parallel_size=2) == 3
    with pytest.raises(ShardingError, match=r"tensor_parallel_size=2, pipeline stages, sharding=3.*sharding=2.*"
                                            r"sharding=1"):
        _sharding_level({"sharding": 3}, tensor_parallel_size=2, stages=True)


def test_all_level_3_of_stages_of_tensor_groups_from_the_environment_names_it(monkeypatch):
    from tarantella.hybrid._strategy import _sharding_level

    monkeypatch.setenv("TNT_SHARDING", "3")
    with pytest.raises(ShardingError, match="TNT_SHARDING=3"):
        _sharding_level({}, tensor_parallel_size=2, stages=True)


def test_all_bad_level_lists_the_levels():
    with pytest.raises(tnt.SettingError, match=r"sharding=7.*0 \(none\)"):
        tnt.Model(_mlp(), parallel_strategy=tnt.ParallelStrategy.ALL, num_pipeline_stages=2, sharding=7)


@pytest.mark.parametrize("strategy, options", [
    (tnt.ParallelStrategy.PIPELINING, {"num_pipeline_stages": 2}),
    (tnt.ParallelStrategy.TENSOR, {"tensor_parallel_size": 2}),
])
def test_other_strategies_name_data_and_all(strategy, options):
    with pytest.raises(TypeError, match=r"ParallelStrategy.DATA or ParallelStrategy.ALL"):
        tnt.Model(_mlp(), parallel_strategy=strategy, sharding=1, **options)


def test_all_replicas_of_tensor_groups_take_every_level():
    """ALL's replica axis without stages: the level passes to the tensor groups' replicas."""
    from tarantella.hybrid._strategy import _sharding_level

    assert [_sharding_level({"sharding": k}, tensor_parallel_size=2) for k in (0, 1, 2, 3)] == [0, 1, 2, 3]


def test_all_pipeline_stages_of_tensor_groups_refuse_level_3(monkeypatch):
    """4 ranks: 2 stages of 2-rank tensor groups: level 3 names levels 1 and 2."""
    from tarantella._core import runtime

    monkeypatch.setattr(runtime, "get_size", lambda: 4)
    with pytest.raises(ShardingError, match=r"pipeline stages, sharding=3.*sharding=2.*sharding=1"):
        tnt.Model(_mlp(), parallel_strategy=tnt.ParallelStrategy.ALL, tensor_parallel_size=2,
                  num_pipeline_stages=2, sharding=3)


class _Comm:
    """A stand-in replica group (rank and size only: ownership needs no messages)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def test_a_replica_group_with_more_replicas_than_variables_names_the_fix():
    from tarantella.data_parallel import Sharding

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])  # 2 trainable variables
    assert Sharding(model, 2, comm=_Comm(0, 2)).owners == [0, 1]  # enough: kernel, bias
    with pytest.raises(ShardingError, match=r"3 replicas.*only 2 trainable variables.*sharding=0"):
        Sharding(model, 2, comm=_Comm(0, 3)).owned_variables()


class _Pipeline:
    """A stand-in transport of a 2-stage pipeline whose other stage reports ``other``."""

    num_stages = 2

    def __init__(self, other: float) -> None:
        self.other = other

    def pipeline_allreduce(self, array):
        return np.asarray(array) + np.array([0.0, self.other])


def test_a_stage_with_fewer_variables_than_replicas_fails_on_every_stage():
    from tarantella.pipelining._shards import check_enough_variables

    check_enough_variables(2, 2, 0, 2, _Pipeline(0.0))  # both stages hold enough: no error
    # Stage 0 holds enough, stage 1 (seen through the allreduce) does not: stage 0 raises too.
    with pytest.raises(ShardingError, match=r"stage\(s\) \[1\].*sharding=0"):
        check_enough_variables(4, 2, 0, 2, _Pipeline(1.0))


def test_tensor_group_replicas_shard_on_the_replica_group_and_decide_over_the_job():
    """replica_sharding: ownership on the replica group; the loss-scale decision on the whole
    job (a shard's gradients differ between the ranks of a tensor group); none without replicas."""
    import types

    import tnt_comm
    from tarantella.tensor_parallel._model import replica_sharding

    group = _Comm(1, 2)
    tpm = types.SimpleNamespace(_tnt_replicas=group)
    sharding = replica_sharding(tpm, 2)
    assert (sharding.comm, sharding.rank, sharding.size, sharding.level) == (group, 1, 2, 2)
    assert sharding.decisions is not group and sharding.decisions.size == tnt_comm.world().size
    assert replica_sharding(tpm, 0) is None
    assert replica_sharding(types.SimpleNamespace(_tnt_replicas=None), 1) is None
