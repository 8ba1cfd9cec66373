"""examples/pipeline_mlp.py on 2 ranks (2 stages) learns the digits (> 90 % test accuracy)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import _launcher

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pipeline_mlp.py"


def test_pipeline_mlp_on_two_stages():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [_launcher(), "-n", "2", "--python-interpreter", sys.executable, "--", str(EXAMPLE), "--epochs", "6"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "2 stages (markers)" in proc.stdout, proc.stdout[-3000:]  # the plan summary
    found = re.search(r"ranks: (\d+)\s+test loss: [\d.]+\s+test accuracy: ([\d.]+)", proc.stdout)
    assert found, proc.stdout[-4000:]
    assert int(found.group(1)) == 2
    assert float(found.group(2)) > 0.9, proc.stdout[-2000:]
    assert len(re.findall(r"^Epoch 1/6", proc.stdout, flags=re.M)) == 1  # progress from the master only
