"""ParallelStrategy.ALL, 2 data replicas x 2 tensor shards on 4 ranks, equals serial Keras.

One launch (jobs/tensor_all.py) of an MLP with an edited plan (a replicated Dense pair, a
split pair, a column+allgather head) and Adam. Checked: History, evaluate, predict and
the gathered weights against serial Keras on the same global batches; every rank holds
the same logs and weights; replicated variables bitwise equal on all four ranks (within
each tensor group and across the replicas) and each shard bitwise equal to its copy in
the other replica.
"""

from __future__ import annotations

import pytest
from conftest import launch, print_diff_table

RANKS, T = 4, 2
CASES = {"mlp_adam_edited": {"up2": "column", "down2": "row", "head": "column+allgather"}}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tensor_all") / "tensor_all.json"
    result = launch(RANKS, "tensor_all.py", out)
    assert result["ranks"] == RANKS
    print_diff_table(f"ALL: 2 replicas x t={T}", result["cases"])
    return result


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_from_layout_map_or_edit(report, case):
    assert report["cases"][case]["plan"] == CASES[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_serial(report, case):
    c = report["cases"][case]
    assert c["start_same"], "the model did not start from the serial weights"
    assert c["history_diff"] <= c["tol_loss"], c["history_diff"]
    assert c["evaluate_diff"] <= c["tol_loss"], c["evaluate_diff"]
    assert c["weight_diff"] <= c["tol_weights"], c["weight_diff"]
    assert c["predict_diff"] <= c["tol_weights"], c["predict_diff"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rank_sees_the_same_logs_and_weights(report, case):
    c = report["cases"][case]
    assert c["histories_per_rank_equal"]
    assert c["weights_per_rank_equal"]
    assert c["gathered_shapes"] == c["serial_shapes"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_replicas_and_groups_hold_bitwise_equal_copies(report, case):
    c = report["cases"][case]
    replicated, shards = c["replicated_checksums"], c["shard_checksums"]
    assert len(replicated) == RANKS and len(set(replicated)) == 1, replicated
    assert shards[0] == shards[2] and shards[1] == shards[3], shards   # shard s in both replicas
    assert shards[0] != shards[1], "both ranks of a tensor group hold the same shard"


def test_each_rank_holds_only_its_shards(report):
    for rank_vars in report["cases"]["mlp_adam_edited"]["local_shapes"]:
        shapes = {path.split("/")[0] + "/" + path.rsplit("/", 1)[-1]: s for path, s in rank_vars.items()}
        assert shapes["up1/kernel"] == [10, 16] and shapes["down1/kernel"] == [16, 12]   # replicated
        assert shapes["up2/kernel"] == [12, 12] and shapes["down2/kernel"] == [12, 8]    # column / row
        assert shapes["head/kernel"] == [8, 2] and shapes["head/bias"] == [2]            # column+allgather
