"""The timeline's pieces without a launch: the merge onto one clock, the summary's
figures on a hand-written trace, the command line. (Launched: test_pipelining_zb_h1.py.)"""

from __future__ import annotations

import json

import pytest

import tarantella as tnt
from tarantella._core import trace as _trace
from tarantella.timeline import format_summary, summarize
from tarantella.timeline.__main__ import main
from tarantella.timeline._merge import chrome_trace


def _x(pid, cat, start_ms, end_ms, name=None, **args):
    return {"name": name or cat, "cat": cat, "ph": "X", "pid": pid, "tid": 0, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": args}


#: rank 0, a pipeline stage: one 10 ms step, F 2 ms, B 1, W 1, a 1 ms send, a 1 ms receive wait.
#: rank 1, data parallelism: a bucket from 1 to 5 ms, the step's wait from 4 to 6 ms.
TRACE = {"traceEvents": [
    {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
    _x(0, "step", 0, 10, stage=0), _x(0, "forward", 0, 2, "F0", stage=0), _x(0, "send", 2, 3, peer=1, bytes=64),
    _x(0, "recv", 3, 4, peer=1), _x(0, "backward", 4, 5, "B0", stage=0), _x(0, "weight", 5, 6, "W0", stage=0),
    _x(1, "bucket", 1, 5), _x(1, "wait", 4, 6),
]}


def test_summary_figures_by_hand():
    s = summarize(TRACE)
    r0, r1 = s["ranks"]
    assert r0["stages"] == [0] and r0["steps"] == 1
    assert r0["window_s"] == pytest.approx(0.010) and r0["compute_s"] == pytest.approx(0.004)
    assert (r0["forward_s"], r0["backward_s"], r0["weight_s"]) == pytest.approx((0.002, 0.001, 0.001))
    assert r0["exposed_communication_s"] == pytest.approx(0.001) and r0["overlap_fraction"] == pytest.approx(0.0)
    assert r0["idle_s"] == pytest.approx(0.005) and r0["idle_fraction"] == pytest.approx(0.5)  # receive wait is idle
    assert r0["bytes_sent"] == 64
    # no step events: first to last event; the bucket before the wait ran behind backprop
    assert r1["window_s"] == pytest.approx(0.005) and r1["communication_s"] == pytest.approx(0.005)
    assert r1["exposed_communication_s"] == pytest.approx(0.002) and r1["overlap_fraction"] == pytest.approx(0.6)
    assert r1["idle_s"] is None and r1["idle_fraction"] is None  # no passes recorded: compute unknown
    assert s["slowest_stage"] == {"stage": 0, "rank": 0, "compute_s": pytest.approx(0.004)}
    text = format_summary(s)
    assert "slowest stage: 0 (rank 0, compute 0.004 s)" in text
    assert text.splitlines()[1].split()[:5] == ["0", "0", "1", "0.010", "0.004"]


def test_merge_puts_ranks_on_the_master_clock():
    # rank 1's clock runs 2.5 s ahead: its event at its 102.5 s is the master's 100.0 s
    parts = [{"wall_minus_perf": 100.0, "meta": {}, "events": [("F0", "forward", "compute", 0.0, 0.5, {"stage": 0})]},
             {"wall_minus_perf": 102.0, "meta": {}, "events": [("F0", "forward", "compute", 0.5, 1.0, {"stage": 1})]}]
    trace = chrome_trace(parts, [0.0, 2.5], [0.0, 1e-4])
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in xs] == [(0, 0.0, 500000.0), (1, 0.0, 500000.0)]
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "rank 0 (stage 0)"), (1, "rank 1 (stage 1)")}
    assert trace["otherData"]["tarantella"]["clock_offset_error_s"] == [0.0, 5e-5]


def test_one_rank_context_manager_and_command_line(tmp_path, capsys):
    path = tmp_path / "t.json"
    assert _trace.recorder() is None  # off: nothing records
    with tnt.timeline(path):
        rec = _trace.recorder()
        rec.add("step", "step", "step", 1.0, 1.5, stage=0)
        rec.add("F0", "forward", "compute", 1.0, 1.2, stage=0)
    assert _trace.recorder() is None
    assert main(["summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "slowest stage: 0 (rank 0, compute 0.200 s)" in out
    assert main(["summary", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["idle_s"] == pytest.approx(0.3)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["summary", str(bad)]) == 2
    assert "is not a timeline: no 'traceEvents'" in capsys.readouterr().err
    with pytest.raises(TypeError, match=r"tnt.timeline\(path\): path must be a file path, got 3"):
        with tnt.timeline(3):
            pass
