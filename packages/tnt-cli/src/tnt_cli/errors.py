"""Errors the launcher reports to the user as one line, with the exit code to use."""

from __future__ import annotations


class LaunchError(Exception):
    """A problem the user can fix (bad option, missing tool); printed as one line.

    `exit_code` is 2 for wrong usage (like every command-line tool) and 1 for a
    problem of the environment (no MPI found, launcher failed to start).
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class UsageError(LaunchError):
    """Wrong or conflicting command-line input (exit code 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=2)


class EnvironmentProblem(LaunchError):
    """Something missing on the machine (MPI, numactl, NUMA info) (exit code 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=1)
