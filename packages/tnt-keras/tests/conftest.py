"""Launch real multi-rank jobs for the tnt-keras tests.

Each job script under ``jobs/`` runs many checks in one launch (importing TensorFlow
costs seconds per process) and has rank 0 write its measurements as JSON; the tests
read that file and assert. Jobs go through the ``tarantella`` launcher, as a user's do.
The jobs that the collected modules run on the same number of ranks share one launch
(``register``, ``bundled``): each rank imports TensorFlow once for all of them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

JOBS = Path(__file__).parent / "jobs"
JOB_TIMEOUT_S = 600


def _launcher() -> str:
    found = shutil.which("tarantella", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise RuntimeError("the `tarantella` launcher is not installed (pip install packages/tnt-cli)")
    return found


def launch(ranks: int, job: str, out: Path, *args: str, timeout: float = JOB_TIMEOUT_S) -> dict:
    """Run ``jobs/<job>`` on ``ranks`` processes; return the JSON rank 0 wrote to ``out``."""
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "TF_DETERMINISTIC_OPS": "1",
        "PYTHONUNBUFFERED": "1",
        # One compute thread per rank: ranks share 2 cores on the CI machine.
        "OMP_NUM_THREADS": "1",
    }
    cmd = [_launcher(), "-n", str(ranks), "--python-interpreter", sys.executable, "--",
           str(JOBS / job), "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(
            f"job {job} on {ranks} ranks exited {proc.returncode}\n--- stdout ---\n"
            f"{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return json.loads(out.read_text())


Args = tuple[str, ...] | Callable[[], tuple[str, ...]]
#: {ranks: {job: (the registering module, its extra args or a function giving them at
#: launch)}}: the jobs the test modules run on that many ranks, registered at import
#: (``register``) so that the first fixture to need one runs them all.
_PARTS: dict[int, dict[str, tuple[str, Args]]] = {}
#: {(ranks, job): its JSON, or the failure message of the launch that ran it}
_RESULTS: dict[tuple[int, str], dict | str] = {}


def register(ranks: int, job: str, *args: str, later: Callable[[], tuple[str, ...]] | None = None) -> None:
    """Declare that this module runs ``jobs/<job> args`` on ``ranks`` ranks (see ``bundled``);
    ``{dir}`` in an argument stands for the job's own directory (where its JSON goes).
    ``later()``, if given, gives the args when the launch starts (after earlier launches)."""
    module = sys._getframe(1).f_globals["__file__"]
    _PARTS.setdefault(ranks, {})[job] = (module, later if later is not None else args)


def pytest_collection_finish(session) -> None:
    """Bundle only the jobs of modules with selected tests (``-k``, a node id): the others'
    jobs would run for nothing."""
    selected = {os.path.realpath(item.path) for item in session.items}
    for jobs in _PARTS.values():
        for job in [j for j, (module, _) in jobs.items() if os.path.realpath(module) not in selected]:
            del jobs[job]


def bundled_if_ran(ranks: int, job: str) -> dict | None:
    """The JSON ``jobs/<job>`` wrote on ``ranks`` ranks if a launch ran it, else None."""
    result = _RESULTS.get((ranks, job))
    return result if isinstance(result, dict) else None


def bundled(ranks: int, job: str, tmp_path_factory) -> dict:
    """The JSON ``jobs/<job>`` wrote on ``ranks`` ranks. Every job registered for that rank
    count runs in the same launch (jobs/_bundle.py), one after the other in the same
    processes: each rank pays the imports (TensorFlow: 5-15 s) once, not once per job."""
    if (ranks, job) not in _RESULTS:
        registered = {j: args for j, (_, args) in _PARTS.get(ranks, {}).items() if (ranks, j) not in _RESULTS}
        parts: dict[str, Args] = {job: (), **registered}
        tmp = tmp_path_factory.mktemp(f"bundle{ranks}")
        outs = {j: tmp / Path(j).stem / f"{Path(j).stem}.json" for j in parts}  # a directory each
        for out in outs.values():
            out.parent.mkdir()
        spec = tmp / "spec.json"
        spec.write_text(json.dumps([
            {"job": j, "argv": ["--out", str(outs[j]),
                                *(a.replace("{dir}", str(outs[j].parent)) for a in (args() if callable(args) else args))]}
            for j, args in parts.items()]))
        timeout = JOB_TIMEOUT_S * len(parts)
        try:
            launch(ranks, "_bundle.py", tmp / "bundle.json", "--spec", str(spec), timeout=timeout)
            for j, out in outs.items():
                _RESULTS[(ranks, j)] = json.loads(out.read_text())
        except pytest.fail.Exception as failed:
            for j in parts:
                _RESULTS[(ranks, j)] = f"launch of {sorted(parts)} on {ranks} ranks failed:\n{failed}"
    result = _RESULTS[(ranks, job)]
    if isinstance(result, str):
        pytest.fail(result)
    return result


def launched_checks(ranks: int, job: str, tmp_path_factory) -> dict:
    """Run a check-registry job (see jobs/api.py) and return its {name: {ok, detail}}."""
    result = bundled(ranks, job, tmp_path_factory)
    assert result["ranks"] == ranks
    return result["checks"]


def assert_check(checks: dict, name: str) -> None:
    assert name in checks, f"check {name} did not run; ran: {sorted(checks)}"
    assert checks[name]["ok"], f"{name}: {checks[name]['detail']}"


def print_diff_table(title: str, cases: dict, extra=None) -> None:
    """Print each case's largest differences to serial Keras (History, weights, evaluate,
    predict), so the test log carries the measured figures; ``extra(case)`` adds a column."""
    width = max([4, *map(len, cases)])
    rows = [f"{'case':{width}} {'hist':>9} {'weights':>9} {'eval':>9} {'predict':>9}"]
    for name, c in cases.items():
        rows.append(f"{name:{width}} {c['history_diff']:9.2e} {c['weight_diff']:9.2e} "
                    f"{c['evaluate_diff']:9.2e} {c['predict_diff']:9.2e}" + (extra(c) if extra else ""))
    print(f"\n{title} (max abs difference to serial Keras)\n" + "\n".join(rows))
