"""Sharded data parallelism, ``tnt.Model(sharding=1|2)`` (docs/sharding.md), launched on 2 and
3 ranks (uneven byte shares) against serial Keras in the same job (jobs/sharded.py): History
and weights, identical replicas, optimizer slots only for owned variables, global_clipnorm
and a LossScaleOptimizer, a level-2 file saved at d = 2 read by serial Keras and resumed at
level 1, and the errors."""

from __future__ import annotations

import pytest
from conftest import share

from tarantella.data_parallel import assign_owners

TOL_LOSS, TOL_WEIGHTS = 1e-5, 2e-5  # float32 summation order, as tests/test_exactness.py
# The cases each launch runs (suite time: two launches of a few fits each).
RUNS = {
    2: ["l2_adam_clip", "l1_lso_sgd", "files", "errors"],
    3: ["l1_adam_clip", "l2_sgd_momentum"],
}
SLOTS_PER_VARIABLE = {"sgd_momentum": 1, "lso_sgd": 1, "adam": 2, "adam_clip": 2}


_REPORTS: dict[int, dict] = {}


for _ranks, _cases in RUNS.items():  # in the shared launches (shared_launch.py)
    share(__name__, _ranks, "sharded", "sharded.py", "--only", ",".join(_cases))


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
    wanted = [n for n in RUNS[report["ranks"]] if n not in ("files", "errors")]
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
    assert sorted(errors) == ["bad_level", "level_3_not_implemented", "optimizer_not_per_variable",
                              "other_strategy"]
    for name, e in errors.items():
        assert e["ok"], (name, e["detail"])


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
