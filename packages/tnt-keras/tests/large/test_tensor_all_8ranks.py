"""ParallelStrategy.ALL on 8 ranks: 2 data replicas x 2 pipeline stages x t = 2 (a tiny
model, one short epoch) equals serial Keras; replica 1 holds replica 0's shards.

Outside the default suite (8 TensorFlow processes take minutes on a 2-core machine):
``nox -s keras_large``.
"""

from __future__ import annotations

from conftest import launch, print_diff_table
from test_tensor_all import _matches_serial


def test_replicas_of_pipeline_stages_of_tensor_groups_on_8_ranks(tmp_path):
    result = launch(8, "tensor_all.py", tmp_path / "tensor_all_8.json", "--only", "staged_sgd_8ranks")
    assert result["ranks"] == 8
    c = result["cases"]["staged_sgd_8ranks"]   # rank = (replica * 2 + stage) * 2 + shard
    print_diff_table("ALL: 2 replicas x 2 stages x t=2", result["cases"])
    _matches_serial(c)
    shards = c["shard_checksums"]
    assert shards[:4] == shards[4:] and len(set(shards[:4])) == 4, shards   # replica 1 == replica 0
