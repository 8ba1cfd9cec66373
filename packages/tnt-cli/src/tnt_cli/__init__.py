"""tnt-cli: the Tarantella launcher (`tarantella` / `tnt` console scripts).

Starts a program on N processes through the MPI in use (Open MPI, MPICH, Intel MPI)
or srun inside a Slurm allocation. See docs/launcher.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["__version__", "app", "main"]

if TYPE_CHECKING:
    from tnt_cli.cli import app, main


def __getattr__(name: str) -> Any:
    # Lazy: every rank runs `python -m tnt_cli.rank`, which must not pay for importing
    # typer (about 0.3 s per process) just because the package is imported.
    if name in ("app", "main"):
        from tnt_cli import cli

        return getattr(cli, name)
    raise AttributeError(f"module 'tnt_cli' has no attribute {name!r}")
