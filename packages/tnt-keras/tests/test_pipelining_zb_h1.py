"""ZB-H1 on 2 real ranks (jobs/pipeline_schedules.py): bitwise equal to 1F1B and equal to
serial Keras; the timeline written by ``tnt.timeline`` and by ``TNT_TIMELINE`` merged from
both ranks and summarized. One launch (the job also runs a data-parallel fit whose fusion
buckets the timeline records)."""

from __future__ import annotations

import json

import pytest
from conftest import launch

from tarantella.timeline import load, summarize

TOL_LOSS, TOL_WEIGHTS = 1e-5, 2e-5  # float32 summation order (docs/architecture.md)
M, STEPS = 4, 3  # the job's micro-batches and steps (20 samples, batch 8: 8, 8, 4)


@pytest.fixture(scope="module")
def report(tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("zb_h1") / "zb_h1.json"
    monkeypatch_module.setenv("TNT_TIMELINE", str(out.with_name("env_timeline.json")))
    result = launch(2, "pipeline_schedules.py", out)
    result["env_timeline_path"] = str(out.with_name("env_timeline.json"))
    print("\nzb-h1 on 2 ranks:", json.dumps(result["cases"]), "dp:", json.dumps(result["dp"]))
    return result


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_zb_h1_is_bitwise_1f1b_and_equals_serial(report):
    assert report["ranks"] == 2
    assert report["zb_h1_bitwise_1f1b"] is True and report["zb_h1_history_equals_1f1b"] is True
    for name in ("1f1b", "zb-h1"):
        c = report["cases"][name]
        assert c["history_diff"] <= TOL_LOSS and c["weight_diff"] <= TOL_WEIGHTS, (name, c)
    # activations until W: within 1F1B's bound min(p, m) = 2 on both stages
    assert report["peak_live"] == [2, 2]


def test_zb_h1_timeline_has_both_ranks_passes_and_peers(report):
    t = report["zb_timeline"]
    counts = t["counts"]
    assert sorted(counts) == ["0", "1"]
    for rank, peer in (("0", 1), ("1", 0)):
        cats = counts[rank]["cats"]
        assert cats["forward"] == cats["backward"] == cats["weight"] == M * STEPS, cats
        assert cats["step"] == STEPS and cats["recv"] > 0 and cats["send"] > 0
        assert cats["host"] == STEPS - 1  # Keras' loop between two steps
        assert counts[rank]["peers"] == [peer]
    # each stage ran ZB-H1's order in every step (stage 1 defers one W)
    assert counts["0"]["names"][:12] == "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3".split()
    assert counts["1"]["names"][:12] == "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3".split()
    # merged on one clock: stage 1's F(i) starts after stage 0's F(i) ended
    assert t["causality_gap_s"] >= 0, t["causality_gap_s"]
    assert t["clock"]["ranks"] == 2 and len(t["clock"]["clock_offsets_s"]) == 2
    summary = t["summary"]
    assert [r["stages"] for r in summary["ranks"]] == [[0], [1]]
    for r in summary["ranks"]:
        assert r["steps"] == STEPS and r["compute_s"] > 0 and 0 <= r["idle_fraction"] < 1
        assert r["compute_s"] + r["idle_s"] + r["exposed_communication_s"] == pytest.approx(r["window_s"])
    assert summary["slowest_stage"]["stage"] in (0, 1)


def test_data_parallel_timeline_has_buckets_and_waits(report):
    dp = report["dp"]
    assert dp["history_diff"] <= TOL_LOSS and dp["weight_diff"] <= TOL_WEIGHTS, dp
    counts = report["dp_timeline"]["counts"]
    for rank in ("0", "1"):
        assert counts[rank]["cats"]["bucket"] >= STEPS and counts[rank]["cats"]["wait"] == STEPS, counts


def test_env_timeline_holds_the_whole_job(report):
    trace = load(report["env_timeline_path"])  # written at exit, after the job's report
    summary = summarize(trace)
    steps = {r["rank"]: r["steps"] for r in summary["ranks"]}
    assert steps == {0: 2 * STEPS, 1: 2 * STEPS}  # 1F1B's and ZB-H1's steps
    cats = {e["cat"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"forward", "backward", "weight", "bucket", "wait"} <= cats
