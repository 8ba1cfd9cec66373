"""The scaling model against step times measured on this machine (issue 15: within 15 %
on 1-4 ranks). The measurements are stored runs of ``benchmarks/scaling_model.py`` on the
idle 2-core VM (``data/``: the ``measured`` part of results/scaling_model.json), so the
test re-models real measurements without timing anything itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import scaling_model

DATA = Path(__file__).parent / "data"
RUNS = sorted(DATA.glob("scaling_idle_*.json"))


def _validate(path: Path) -> dict:
    measured = {int(k): v for k, v in json.loads(path.read_text())["measured"].items()}
    return scaling_model.validate(measured)


def _table(v: dict) -> str:
    return "\n".join(f"{r['ranks']} ranks @{r['threshold_kb']} KB: predicted {r['predicted_s'] * 1e3:.0f} ms, "
                     f"measured {r['measured_s'] * 1e3:.0f} ms ({100 * r['error']:+.1f} %, {r['rule']})"
                     for r in v["rows"])


def test_stored_runs_exist():
    assert len(RUNS) >= 2, RUNS


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.stem)
def test_predicts_every_measured_step_within_15_percent(path):
    v = _validate(path)
    assert {r["ranks"] for r in v["rows"]} == {1, 2, 3, 4}
    assert v["max_abs_error"] <= 0.15, _table(v)


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.stem)
def test_oversubscribed_ranks_use_the_time_sharing_rule(path):
    # 3-4 ranks on 2 cores: the 2-rank profile's backprop stretched by N/2 (plus the
    # submits it runs on the compute thread), not the ranks' own free-running profile
    # (which over-predicted 4 ranks by 29-43 %: kept beside it for comparison).
    measured = json.loads(path.read_text())["measured"]
    backprop_2 = measured["2"]["profile"]["compute_end_s"]
    for r in _validate(path)["rows"]:
        if r["ranks"] > 2:
            assert r["rule"].startswith("time-shared: 2-rank profile"), r
            assert r["compute_end_s"] == pytest.approx(backprop_2 * r["ranks"] / 2, rel=0.005), r
            assert "error_own_profile" in r
