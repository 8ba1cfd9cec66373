"""Shared fixtures: fake MPI starters for command tests, helpers for real launches."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import VERSION_TEXTS, write_executable


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Slurm, no TNT_/TF_ variables, no GPUs from the caller's environment."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TNT_", "TF_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def fake_mpirun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    """Install a fake `mpirun` that only answers `--version` like the named MPI.

    It refuses to start anything else, so a test using it proves no rank was started.
    """

    def install(kind: str) -> Path:
        bindir = tmp_path / f"bin-{kind}"
        bindir.mkdir()
        (bindir / "version.txt").write_text(VERSION_TEXTS[kind])
        script = write_executable(bindir / "mpirun", textwrap.dedent(f"""\
            #!/bin/sh
            if [ "$1" = "--version" ]; then /bin/cat {bindir / 'version.txt'}; exit 0; fi
            echo "fake mpirun must not start ranks" >&2; exit 99
            """))
        monkeypatch.setenv("TNT_MPIRUN", str(script))
        return script

    return install


@pytest.fixture
def script(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write a small Python program for the ranks to run."""

    def make(name: str, source: str) -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return make
