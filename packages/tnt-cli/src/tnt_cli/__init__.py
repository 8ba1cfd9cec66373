"""tnt-cli: the Tarantella launcher (`tarantella` / `tnt` console scripts).

Starts a program on N processes through the MPI in use (Open MPI, MPICH, Intel MPI)
or srun inside a Slurm allocation. See docs/launcher.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

from tnt_cli.cli import app, main

__all__ = ["__version__", "app", "main"]
