"""Launched: examples/gpt2_pipeline.py trains keras-hub's GPT2CausalLM on 2 ranks with
PIPELINING (2 stages) and with TENSOR (2 shards) and learns its counting task."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _launcher

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt2_pipeline.py"
SMALL = ("--epochs", "2", "--samples", "512", "--batch-size", "16")


@pytest.mark.parametrize("strategy", ["pipelining", "tensor"])
def test_gpt2_on_two_ranks(strategy):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [_launcher(), "-n", "2", "--python-interpreter", sys.executable, "--", str(EXAMPLE), "--strategy", strategy,
         *SMALL],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    found = re.search(r"strategy: (\w+)\s+ranks: (\d+)\s+test loss: [\d.]+\s+next-token accuracy: ([\d.]+)", out)
    assert found, out[-4000:]
    assert found.group(1) == strategy and found.group(2) == "2"
    # 64 tokens (chance 0.016); measured 1.0000 under both strategies (docs/examples.md):
    # the bar sits 20 % below.
    assert float(found.group(3)) >= BAR, out[-2000:]
    assert len(re.findall(r"^Epoch 1/2", out, flags=re.M)) == 1  # progress from the master only


BAR = 0.8
