"""`--cleanup`: finds the program's processes (not our own ancestors) and stops them."""

from __future__ import annotations

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
        proc = subprocess.Popen([PY, str(prog)])
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


def test_cleanup_stops_the_program(leftover, capsys) -> None:
    prog, proc = leftover()
    other_prog, other = leftover()
    assert main(["--cleanup", "--", str(prog)]) == 0
    assert proc.wait(timeout=10) != 0
    assert other.poll() is None  # another program is left alone
    assert f"stopping {proc.pid}" in capsys.readouterr().out
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


def test_nothing_found() -> None:
    assert cleanup_mod.find_program_processes("/no/such/program-xyz.py") == []
