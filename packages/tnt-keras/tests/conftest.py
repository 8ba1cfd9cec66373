"""Launch real multi-rank jobs for the tnt-keras tests.

Each job script under ``jobs/`` runs many checks in one launch (importing TensorFlow
costs seconds per process) and has rank 0 write its measurements as JSON; the tests
read that file and assert. Jobs go through the ``tarantella`` launcher, as a user's do.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).parent / "jobs"
JOB_TIMEOUT_S = 600
ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
# tests/run_scripts.py (the repository's): several scripts in one launch, TensorFlow
# imported once per rank for all of them; `script_output` cuts one script's output.
sys.path.insert(0, str(ROOT / "tests"))
from run_scripts import RUNNER, script_output  # noqa: E402
from shared_launch import TIMINGS, SharedLaunches, share  # noqa: E402

# The examples of examples/ that tnt-keras' tests run, each at a small size: id -> script
# and arguments. They share one 2-rank launch (fixture `examples_run`).
EXAMPLE_RUNS = {
    "gan": ("custom_train_step_gan.py", "--epochs", "15", "--samples", "1024"),
    "pipeline_mlp": ("pipeline_mlp.py", "--epochs", "6"),
    # One block, shorter sequences, 2 epochs of 16 steps: enough to learn the task (~0.97).
    "transformer_tensor_parallel": ("transformer_tensor_parallel.py", "--samples", "1024", "--epochs", "2",
                                    "--blocks", "1", "--length", "12", "--save", "{workdir}/transformer.keras"),
    "gpt2_pipelining": ("gpt2_pipeline.py", "--strategy", "pipelining", "--epochs", "2", "--samples", "512",
                        "--batch-size", "16"),
    "gpt2_tensor": ("gpt2_pipeline.py", "--strategy", "tensor", "--epochs", "2", "--samples", "512",
                    "--batch-size", "16"),
}


def _launcher() -> str:
    found = shutil.which("tarantella", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise RuntimeError("the `tarantella` launcher is not installed (pip install packages/tnt-cli)")
    return found


class ExamplesRun:
    """The finished 2-rank launch of every example in EXAMPLE_RUNS, one after another."""

    def __init__(self, proc: subprocess.CompletedProcess, workdirs: dict[str, Path]) -> None:
        self.proc, self.workdirs = proc, workdirs

    def output(self, example: str) -> str:
        """The master's output of one example; fails naming the job's end if it did not finish."""
        out = script_output(self.proc.stdout, example)
        if out is None:
            pytest.fail(f"example {example} failed or never ran (the launch exited {self.proc.returncode})\n"
                        f"--- stdout ---\n{self.proc.stdout[-6000:]}\n--- stderr ---\n{self.proc.stderr[-6000:]}")
        return out


@pytest.fixture(scope="session")
def examples_run(tmp_path_factory) -> ExamplesRun:
    workdirs = {name: tmp_path_factory.mktemp(name) for name in EXAMPLE_RUNS}
    specs = []
    for name, (script, *args) in EXAMPLE_RUNS.items():
        args = [a.format(workdir=workdirs[name]) for a in args]
        specs.append(f"{name}=" + shlex.join([str(workdirs[name]), str(EXAMPLES / script), *args]))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [_launcher(), "-n", "2", "--python-interpreter", sys.executable, "--",
           str(RUNNER), *specs]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S + 300)
    return ExamplesRun(proc, workdirs)


def _job_env() -> dict[str, str]:
    return {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "TF_DETERMINISTIC_OPS": "1",
        "PYTHONUNBUFFERED": "1",
        # One compute thread per rank: ranks share 2 cores on the CI machine.
        "OMP_NUM_THREADS": "1",
    }


def pytest_terminal_summary(terminalreporter) -> None:
    """Where the shared launches' time went, by part (the logs of CI show it without -s)."""
    if TIMINGS:
        terminalreporter.section("shared launches")
        for line in TIMINGS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def shared_launches(request, tmp_path_factory) -> SharedLaunches:
    """The jobs registered with ``share`` by the test modules, one launch per rank count
    (shared_launch.py): ``shared_launches.result(ranks, part)`` is a part's JSON."""
    command = [_launcher(), "--python-interpreter", sys.executable, "--"]
    return SharedLaunches(request.session, tmp_path_factory, command, _job_env(), JOB_TIMEOUT_S)


def launch(ranks: int, job: str, out: Path, *args: str, timeout: float = JOB_TIMEOUT_S) -> dict:
    """Run ``jobs/<job>`` on ``ranks`` processes; return the JSON rank 0 wrote to ``out``."""
    env = _job_env()
    cmd = [_launcher(), "-n", str(ranks), "--python-interpreter", sys.executable, "--",
           str(JOBS / job), "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(
            f"job {job} on {ranks} ranks exited {proc.returncode}\n--- stdout ---\n"
            f"{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return json.loads(out.read_text())


share(("test_real_models", "test_real_models_pipeline", "test_real_models_tensor"), 2, "real_models",
      "real_models_2ranks.py")


@pytest.fixture(scope="session")
def real_models_parts(shared_launches) -> dict:
    """keras-hub models under DATA, PIPELINING and TENSOR on 2 ranks (jobs/real_models_2ranks.py,
    in the shared 2-rank launch); {part: {case: measurements}}."""
    result = shared_launches.result(2, "real_models")
    assert result["ranks"] == 2
    print(f"\nreal_models_2ranks seconds by part: {result.get('seconds')}")
    return result["parts"]


def launched_checks(ranks: int, job: str, shared_launches: SharedLaunches) -> dict:
    """A check-registry job's (see jobs/api.py) {name: {ok, detail}}, from the shared
    ``ranks``-rank launch (the test module registers it: ``share(__name__, ranks, part, job)``)."""
    result = shared_launches.result(ranks, Path(job).stem)
    assert result["ranks"] == ranks
    return result["checks"]


def assert_check(checks: dict, name: str) -> None:
    assert name in checks, f"check {name} did not run; ran: {sorted(checks)}"
    assert checks[name]["ok"], f"{name}: {checks[name]['detail']}"


def assert_one_model_across_replicas(bn: dict, plain_keras_tol: float = 0.0) -> None:
    """jobs/_replica_stats.py's report: the trained model, its file reloaded, plain Keras'
    load of the file and every rank hold one model (batch-norm statistics averaged).
    ``plain_keras_tol``: where the layout computes a layer in another order than plain Keras
    (a tensor split sums partial products), how far plain Keras' predictions may be; the
    layout against itself stays bitwise."""
    assert bn["trained_vs_reloaded_predict_diff"] == 0.0, bn
    assert bn["trained_vs_reloaded_loss_diff"] == 0.0, bn
    assert bn["ranks_loss_spread"] == 0.0, bn
    assert bn["plain_keras_vs_reloaded_predict_diff"] <= plain_keras_tol, bn


def print_diff_table(title: str, cases: dict, extra=None) -> None:
    """Print each case's largest differences to serial Keras (History, weights, evaluate,
    predict), so the test log carries the measured figures; ``extra(case)`` adds a column."""
    width = max([4, *map(len, cases)])
    rows = [f"{'case':{width}} {'hist':>9} {'weights':>9} {'eval':>9} {'predict':>9}"]
    for name, c in cases.items():
        rows.append(f"{name:{width}} {c['history_diff']:9.2e} {c['weight_diff']:9.2e} "
                    f"{c['evaluate_diff']:9.2e} {c['predict_diff']:9.2e}" + (extra(c) if extra else ""))
    print(f"\n{title} (max abs difference to serial Keras)\n" + "\n".join(rows))
