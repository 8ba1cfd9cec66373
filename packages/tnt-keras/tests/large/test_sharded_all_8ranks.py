"""ALL on 8 ranks: sharding=2 within the replica groups of pipeline stages of tensor groups
(2 replicas x 2 stages x t = 2, Adam) equals serial Keras; each (stage, shard)'s replicas are
bitwise alike and partition its optimizer slots; the saved file is serial Keras'.

Outside the default suite (8 TensorFlow processes take minutes on a 2-core machine):
``nox -s keras_large``.
"""

from __future__ import annotations

from conftest import launch

TOL_LOSS, TOL_WEIGHTS = 1e-5, 2e-5


def test_sharded_replicas_of_pipeline_stages_of_tensor_groups_on_8_ranks(tmp_path):
    r = launch(8, "sharded_all8.py", tmp_path / "sharded_all8.json")
    assert r["history_diff"] <= TOL_LOSS and r["weight_diff"] <= TOL_WEIGHTS, r
    groups: dict[tuple[int, int], list] = {}
    for stage, shard, _replica, digest, slots, variables in r["ranks"]:
        groups.setdefault((stage, shard), []).append((digest, slots, variables))
    assert len(groups) == 4, r
    for key, members in groups.items():
        assert len(members) == 2 and len({d for d, _, _ in members}) == 1, (key, members)
        variables = members[0][2]
        per_var = [s - 2 for _, s, _ in members]  # Adam: iterations and learning rate on each
        assert sum(per_var) == 2 * variables and all(0 < s < 2 * variables for s in per_var), (key, members)
    count, serial_count = r["loaded_optimizer_count"]
    assert count == serial_count, r
    assert r["loaded_weight_diff"] <= TOL_WEIGHTS and r["loaded_optimizer_diff"] <= TOL_WEIGHTS, r
