"""Launched pipelining scripts: examples/pipeline_mlp.py learns the digits on 2 stages; a failing stage ends the job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from conftest import _launcher


def test_pipeline_mlp_on_two_stages(examples_run):
    out = examples_run.output("pipeline_mlp")  # the examples' shared launch (conftest.py)
    assert "2 stages (markers)" in out, out[-3000:]  # the plan summary
    found = re.search(r"ranks: (\d+)\s+test loss: [\d.]+\s+test accuracy: ([\d.]+)", out)
    assert found, out[-4000:]
    assert int(found.group(1)) == 2
    # 10 digits (chance 0.1); measured 0.975-0.981 with oneDNN on/off and three seeds
    # (tools/example_margins.py): the bar sits 20 % below the smallest value seen.
    assert float(found.group(2)) >= 0.75, out[-2000:]
    assert len(re.findall(r"^Epoch 1/6", out, flags=re.M)) == 1  # progress from the master only


def test_a_failing_stage_ends_the_whole_job_at_once(tmp_path):
    out = tmp_path / "raised_at.txt"
    job = Path(__file__).parent / "jobs" / "pipeline_failure.py"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TNT_COMM_TIMEOUT": "300"}  # a hang would last 300 s: ending in seconds is the abort
    proc = subprocess.run(
        [_launcher(), "-n", "2", "--python-interpreter", sys.executable, "--", str(job), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    ended = time.time()
    assert proc.returncode != 0
    assert "boom on stage 1" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert out.exists(), proc.stderr[-3000:]
    assert ended - float(out.read_text()) < 30, ended - float(out.read_text())
    leftovers = subprocess.run(["pgrep", "-f", str(job)], capture_output=True, text=True).stdout.split()
    assert not leftovers, leftovers
