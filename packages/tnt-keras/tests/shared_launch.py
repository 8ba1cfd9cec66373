"""Jobs of several test files that run on the same rank count share one launch.

Each launched rank pays TensorFlow's import (~17 s of CPU on the 2-core CI machine) before
any check runs, so a launch per test file and rank count cost the suite minutes. A test
module registers its jobs at import (``share``); pytest imports every module before the
first test runs, so when a test first asks for a rank count's results (``SharedLaunches.
result``), every registered job of that rank count whose test module this session runs
goes into one launch of tests/run_scripts.py: one after another in the same processes,
each as ``python jobs/<job> --out <its file> ...`` would run it (fresh globals, a cleared
Keras session), each writing its own JSON. Launches go in ascending rank count. A job that fails ends the launch (its ranks
could otherwise wait on each other); the jobs that finished before it still report,
every later one fails its tests naming the launch's output.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from run_scripts import RUNNER, TOOK  # tests/ of the repository (conftest.py puts it on sys.path)

JOBS = Path(__file__).parent / "jobs"


@dataclass(frozen=True)
class Part:
    """One job of a shared launch: ``jobs/<job> --out <file> <args>`` for the test
    modules ``modules`` (in an argument, ``{workdir}`` is the job's own directory and
    ``{shared}`` one directory common to every job of the session)."""

    name: str
    job: str
    args: tuple[str, ...]
    modules: tuple[str, ...]


#: rank count -> part name -> Part, filled by ``share`` when the test modules are imported.
_REGISTRY: dict[int, dict[str, Part]] = {}
#: One line per launch with its seconds by part, for the session's terminal summary (CI logs).
TIMINGS: list[str] = []


def share(modules: str | tuple[str, ...], ranks: int, name: str, job: str, *args: str) -> None:
    """Register ``job`` to run in the shared ``ranks``-rank launch as part ``name``, for
    the test module(s) ``modules`` (their ``__name__``: the part runs only if one of them
    has a test this session runs)."""
    modules = (modules,) if isinstance(modules, str) else tuple(modules)
    part = Part(name, job, tuple(args), modules)
    known = _REGISTRY.setdefault(ranks, {})
    if name in known and known[name] != part:
        raise ValueError(f"part {name!r} of the {ranks}-rank launch registered twice, differently")
    known[name] = part


class SharedLaunches:
    """The session's shared launches, one per rank count, each started on first use."""

    def __init__(self, session: pytest.Session, tmp_path_factory, command: list[str], env: dict[str, str],
                 timeout_per_part: float) -> None:
        self._session, self._tmp, self._command = session, tmp_path_factory, command
        self._env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(JOBS), env.get("PYTHONPATH")) if p)}
        self._timeout_per_part = timeout_per_part
        self._launched: dict[int, tuple[subprocess.CompletedProcess, str, dict[str, Path]]] = {}
        self._shared_dir: Path | None = None

    def _wanted(self, ranks: int) -> list[Part]:
        running = {getattr(item, "module", None) and item.module.__name__ for item in self._session.items}
        return [p for p in _REGISTRY.get(ranks, {}).values() if running & set(p.modules)]

    def _launch(self, ranks: int) -> None:
        # Fewer ranks first, whichever test asks first: a job may read what a smaller
        # launch's job left (test_pipelining_jobs: the p = 2 file loaded on 3 ranks).
        for smaller in sorted(r for r in _REGISTRY if r < ranks and r not in self._launched):
            if self._wanted(smaller):
                self._launch(smaller)
        parts = self._wanted(ranks)
        outs, specs = {}, []
        if self._shared_dir is None:
            self._shared_dir = self._tmp.mktemp("shared")
        for part in parts:
            workdir = self._tmp.mktemp(f"{part.name}_{ranks}ranks")
            outs[part.name] = workdir / f"{part.name}.json"
            args = [a.format(workdir=workdir, shared=self._shared_dir) for a in part.args]
            specs.append(f"{part.name}=" + shlex.join([str(workdir), str(JOBS / part.job),
                                                       "--out", str(outs[part.name]), *args]))

        t0 = time.perf_counter()
        try:
            proc = subprocess.run([*self._command[:1], "-n", str(ranks), *self._command[1:], str(RUNNER), *specs],
                                  env=self._env, capture_output=True, text=True,
                                  timeout=self._timeout_per_part * max(1, len(parts)))
            note = f"exited {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            proc = subprocess.CompletedProcess(e.cmd, -1, e.stdout or "", e.stderr or "")
            if isinstance(proc.stdout, bytes):
                proc.stdout, proc.stderr = proc.stdout.decode(errors="replace"), (proc.stderr or b"").decode(
                    errors="replace")
            note = f"timed out after {e.timeout:.0f} s"
        took = [line.removeprefix(TOOK).strip() for line in proc.stderr.splitlines() if line.startswith(TOOK)]
        TIMINGS.append(f"shared {ranks}-rank launch: {time.perf_counter() - t0:.0f} s, {note}; parts: {', '.join(took)}")
        print("\n" + TIMINGS[-1])
        self._launched[ranks] = (proc, note, outs)

    def out_file(self, ranks: int, name: str) -> Path:
        """Where part ``name`` writes its JSON (its working directory is the file's folder)."""
        if ranks not in self._launched:
            self._launch(ranks)
        outs = self._launched[ranks][2]
        if name not in outs:
            raise KeyError(f"part {name!r} is not registered for {ranks} ranks (see share())")
        return outs[name]

    def result(self, ranks: int, name: str) -> dict:
        """Part ``name``'s JSON from the shared ``ranks``-rank launch (launched on first use)."""
        out = self.out_file(ranks, name)
        proc, note, outs = self._launched[ranks]
        if not out.exists():
            pytest.fail(f"part {name} of the shared {ranks}-rank launch ({', '.join(outs)}) wrote no result: "
                        f"the launch {note}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n"
                        f"{proc.stderr[-6000:]}")
        return json.loads(out.read_text())
