"""The bad-input catalogue (docs/errors.md): each misuse gives its documented message.

Misuses that need ranks run in one 2-rank launch (jobs/errors.py); the settings errors
are single-process (a plain `python` run is a 1-rank job). Every launch and subprocess
has a deadline, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import assert_check, launched_checks, share

CHECKS = [
    "global_batch_smaller_than_ranks_works",
    "ftrl_supported",
    "error_micro_batch_inconsistent",
    "error_unbatched_without_micro_batch",
    "error_batch_size_with_dataset",
    "error_generator_input",
    "error_fit_before_compile",
    "error_validation_split_with_dataset",
    "error_predict_not_distributed",
    "error_dataset_lengths_differ",
    "error_dataset_lengths_differ_evaluate",
    "own_data_per_rank_same_length_trains",
    "error_uncompiled_loaded_model",
    "error_models_differ_shape",
    "error_models_differ_layers",
    "error_pipeline_plans_differ_by_auto_names",
    "usable_after_errors",
]


share(__name__, 2, "errors", "errors.py")  # in the shared 2-rank launch (shared_launch.py)


@pytest.fixture(scope="module")
def checks(shared_launches):
    return launched_checks(2, "errors.py", shared_launches)


@pytest.mark.parametrize("name", CHECKS)
def test_check(checks, name):
    assert_check(checks, name)


def test_no_unlisted_checks(checks):
    assert sorted(checks) == sorted(CHECKS)


# -- settings: single process --------------------------------------------------------
BAD_SETTINGS = {
    "fusion_negative": ("TNT_FUSION_THRESHOLD", "-1", ["TNT_FUSION_THRESHOLD='-1' is negative", ">= 0"]),
    "fusion_nan": ("TNT_FUSION_THRESHOLD", "nan", ["TNT_FUSION_THRESHOLD='nan' is not a finite number", ">= 0"]),
    "fusion_not_a_number": ("TNT_FUSION_THRESHOLD", "8MB", ["TNT_FUSION_THRESHOLD='8MB' is not a number",
                                                             "in KB", "TNT_FUSION_THRESHOLD=8192"]),
    "log_level": ("TNT_LOG_LEVEL", "LOUD", ["TNT_LOG_LEVEL='LOUD' is not a log level", "DEBUG, INFO"]),
    "flag": ("TNT_OUTPUT_ON_ALL_DEVICES", "maybe", ["TNT_OUTPUT_ON_ALL_DEVICES='maybe' is not a boolean",
                                                      "true/false"]),
    "native_flag": ("TNT_NATIVE_OPS", "fast", ["TNT_NATIVE_OPS='fast' is not a boolean", "true/false"]),
}

_PROBE = """
import json, os, sys
import tarantella
from tarantella._core import settings as _settings
cases = json.loads(sys.argv[1])
out = {}
for case, (name, value) in cases.items():
    os.environ[name] = value
    try:
        _settings.load()
        out[case] = None
    except tarantella.SettingError as err:
        out[case] = str(err)
    del os.environ[name]
print("RESULT " + json.dumps(out))
"""


def _python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return _python_all([(code, args, env)])[0]


def _python_all(runs: list[tuple[str, tuple[str, ...], dict[str, str] | None]]
                ) -> list[subprocess.CompletedProcess[str]]:
    """Run several ``python -c`` processes side by side (each imports TensorFlow: seconds
    of one core), each with its deadline."""
    procs = []
    for code, args, env in runs:
        full = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", **(env or {})}
        cmd = [sys.executable, "-c", code, *args]
        procs.append((cmd, subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True)))
    done = []
    for cmd, proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for _, p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def setting_messages():
    cases = {case: (name, value) for case, (name, value, _) in BAD_SETTINGS.items()}
    proc = _python(_PROBE, json.dumps(cases))
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_bad_setting_value(setting_messages, case):
    message = setting_messages[case]
    assert message is not None, f"{case}: no SettingError"
    for fragment in BAD_SETTINGS[case][2]:
        assert fragment in message, message


_NO_COMPILER = """
import tensorflow as tf, tarantella as tnt, tnt_comm
from tarantella._core import graph_collectives as _graph_collectives
f = tf.function(lambda x: _graph_collectives.allreduce(x, tnt_comm.world(), "t", "ar"))
x = tf.constant([1.0, 2.0, 3.0])
kinds = {op.type for op in f.get_concrete_function(x).graph.get_operations()}
print("RESULT", tnt.native.in_use(), tnt.native.why_not, [float(f(x).numpy().sum())],
      "PyFunc" if "PyFunc" in kinds and "TntAllreduce" not in kinds else sorted(kinds))
"""


def test_bad_setting_fails_at_import_and_unknown_names_warn(tmp_path):
    """A bad value stops `import tarantella` (so every rank stops at once, before any
    collective); a misspelt TNT_* name is reported with a suggestion."""
    bad, typo, timeout, no_compiler = _python_all([
        ("import tarantella", (), {"TNT_FUSION_THRESHOLD": "-5"}),
        ("import tarantella", (), {"TNT_FUSION_TRESHOLD": "64"}),
        ("import tarantella", (), {"TNT_COMM_TIMEOUT": "soon"}),
        (_NO_COMPILER, (), {"CXX": "/nonexistent/c++", "TNT_NATIVE_OPS_CACHE": str(tmp_path)}),
    ])
    # Without a compiler (and no built library in the cache) the collectives fall back to
    # tf.numpy_function ops: same results, one warning saying why.
    assert no_compiler.returncode == 0, no_compiler.stderr[-3000:]
    assert "RESULT False RuntimeError: no C++ compiler (set CXX or install g++) [6.0] PyFunc" in no_compiler.stdout, (
        no_compiler.stdout[-2000:], no_compiler.stderr[-3000:])
    assert "native TensorFlow ops are unavailable" in no_compiler.stderr, no_compiler.stderr[-3000:]
    assert bad.returncode != 0
    assert "SettingError: TNT_FUSION_THRESHOLD='-5' is negative" in bad.stderr, bad.stderr[-3000:]
    assert typo.returncode == 0, typo.stderr[-3000:]
    assert "unknown setting(s) ignored: TNT_FUSION_TRESHOLD (did you mean TNT_FUSION_THRESHOLD?)" in typo.stderr
    assert timeout.returncode != 0
    assert "TNT_COMM_TIMEOUT='soon' is not a number > 0" in timeout.stderr, timeout.stderr[-3000:]
