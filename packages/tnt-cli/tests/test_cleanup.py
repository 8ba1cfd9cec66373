"""`--cleanup`: finds the program's processes started by a launch (marked with
TARANTELLA_JOB_ID), never our own ancestors or unmarked processes naming it, and stops them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import is_running, wait_for

from tnt_cli import cleanup as cleanup_mod
from tnt_cli import main

PY = sys.executable


@pytest.fixture
def leftover(tmp_path: Path):
    """A running 'leftover' program; yields (program path, Popen)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(ignore_term: bool = False) -> tuple[Path, subprocess.Popen[bytes]]:
        prog = tmp_path / f"leftover_{len(started)}.py"
        ready = tmp_path / f"ready_{len(started)}"
        prog.write_text(
            "import signal, sys, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + f"open({str(ready)!r}, 'w').close()\ntime.sleep(300)\n"
        )
        proc = subprocess.Popen([PY, str(prog)], env={**os.environ, "TARANTELLA_JOB_ID": "test-job"})
        started.append(proc)
        wait_for(ready.exists, 30, "the leftover program to start")
        return prog, proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_dry_run_lists_without_stopping(leftover, capsys) -> None:
    prog, proc = leftover()
    assert main(["--cleanup", "--dry-run", "--", str(prog)]) == 0
    out = capsys.readouterr().out
    assert f"would stop {proc.pid}: {PY} {prog}" in out
    assert proc.poll() is None


def test_cleanup_stops_the_program_but_not_a_tail_on_it(leftover, capsys) -> None:
    """`tail -f train.py` names the script too, but no launch started it: spared."""
    prog, proc = leftover()
    other_prog, other = leftover()
    tail = subprocess.Popen(["tail", "-f", str(prog)], stdout=subprocess.DEVNULL)
    try:
        assert main(["--cleanup", "--", str(prog)]) == 0
        assert proc.wait(timeout=10) != 0
        assert other.poll() is None  # another program is left alone
        assert tail.poll() is None, "cleanup stopped a `tail -f` of the script"
        out = capsys.readouterr().out
        assert f"stopping {proc.pid}" in out and str(tail.pid) not in out
    finally:
        tail.kill()
        tail.wait()
    del other_prog


def test_cleanup_by_relative_name_from_the_same_directory(leftover, monkeypatch) -> None:
    prog, proc = leftover()
    monkeypatch.chdir(prog.parent)
    assert main(["--cleanup", "--", prog.name]) == 0
    assert proc.wait(timeout=10) != 0


def test_term_ignoring_program_needs_force(leftover, monkeypatch, capsys) -> None:
    monkeypatch.setattr(cleanup_mod, "GRACE_S", 0.5)
    prog, proc = leftover(ignore_term=True)
    assert main(["--cleanup", "--", str(prog)]) == 1
    assert "use --cleanup --force" in capsys.readouterr().out
    assert is_running(proc.pid)
    assert main(["--cleanup", "--force", "--", str(prog)]) == 0
    assert proc.wait(timeout=10) == -9


def test_cleanup_spares_its_own_ancestors(tmp_path: Path) -> None:
    """The shell that runs the cleanup names the program too, and must survive."""
    prog = tmp_path / "job.py"
    prog.write_text("")
    done = subprocess.run(["sh", "-c", f'{PY} -m tnt_cli --cleanup -- {prog}; echo "survived $0"', str(prog)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0
    assert "no processes of" in done.stdout and f"survived {prog}" in done.stdout


def test_launched_ranks_carry_one_job_id(tmp_path: Path) -> None:
    """What cleanup relies on: every rank of a launch, and its children, have the same
    TARANTELLA_JOB_ID, new for each launch (a caller's own TARANTELLA_JOB_ID is not inherited)."""
    prog = tmp_path / "ids.py"
    prog.write_text(
        "import os, subprocess, sys\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"TARANTELLA_JOB_ID\"])'],"
        " capture_output=True, text=True).stdout.strip()\n"
        "print('ids', os.environ['OMPI_COMM_WORLD_RANK'], os.environ['TARANTELLA_JOB_ID'], child)\n")
    ids = []
    for _ in range(2):
        done = subprocess.run([PY, "-m", "tnt_cli", "-n", "2", "--output-on-all-devices", "--",
                               str(prog)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "TARANTELLA_JOB_ID": "outer"}, check=False)
        assert done.returncode == 0, done.stderr
        rows = sorted(line.split()[2:] for line in done.stdout.splitlines() if " ids " in line)
        assert [r[0] for r in rows] == ["0", "1"], done.stdout
        assert len({r[1] for r in rows} | {r[2] for r in rows}) == 1, rows
        ids.append(rows[0][1])
    assert ids[0] != ids[1] and "outer" not in ids


def test_nothing_found() -> None:
    assert cleanup_mod.find_program_processes("/no/such/program-xyz.py") == []
