"""Checkpoint and resume on 2 ranks: a job killed while writing a checkpoint, restarted
with the same command, continues exactly where an uninterrupted run would be.

Launch 1 (jobs/resume.py) is SIGKILLed on rank 0 in the middle of a ModelCheckpoint
save, after BackupAndRestore saved the epoch. Launch 2 (the same command) checks the
last checkpoint is intact, resumes both ways (BackupAndRestore, and load_model +
fit(initial_epoch)) and compares with an uninterrupted run in the same process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import JOBS, _launcher, launch

CHECKS = [
    "checkpoint_intact",
    "first_run_history_equal",
    "backup_resumed_at_next_epoch",
    "backup_resume_equals_uninterrupted",
    "backup_dir_deleted_at_end",
    "manual_resume_equals_uninterrupted",
    "replicas_identical",
]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    out = folder / "result.json"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_DETERMINISTIC_OPS": "1",
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [_launcher(), "-n", "2", "--python-interpreter", sys.executable, "--",
           str(JOBS / "resume.py"), "--out", str(out)]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    state = {
        "first_exit": first.returncode,
        "first_output": first.stderr[-4000:],
        "interrupted": (folder / "interrupted").exists(),
        "backup_files": sorted(p.name for p in (folder / "backup").iterdir()) if (folder / "backup").exists() else None,
        "metadata": json.loads((folder / "backup" / "training_metadata.json").read_text())
        if (folder / "backup" / "training_metadata.json").exists() else None,
        "temporaries": sorted(p.name for p in folder.iterdir() if ".tmp" in p.name),
    }
    state["checks"] = launch(2, "resume.py", out)["checks"] if state["interrupted"] else {}
    return state


def test_first_run_was_killed_mid_save(resumed):
    assert resumed["first_exit"] != 0 and resumed["interrupted"], resumed["first_output"]
    # The half-written temporary is still there; model.keras was never replaced by it.
    assert any(name.startswith(".model.keras.") for name in resumed["temporaries"]), resumed["temporaries"]


def test_backup_written_by_master_only(resumed):
    # One weights file and one metadata file (no per-rank copies, no temporaries), and the
    # metadata names the epoch after the last complete one.
    assert resumed["backup_files"] == ["latest.weights.h5", "training_metadata.json"], resumed["backup_files"]
    assert resumed["metadata"] == {"epoch": 2, "batch": 0}, resumed["metadata"]


@pytest.mark.parametrize("name", CHECKS)
def test_check(resumed, name):
    checks = resumed["checks"]
    assert name in checks, f"check {name} did not run; ran: {sorted(checks)}"
    assert checks[name]["ok"], f"{name}: {checks[name]['detail']}"
