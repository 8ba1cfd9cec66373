"""Exceptions raised by tnt_comm (the C++ core raises these same classes)."""

from __future__ import annotations


class CommError(RuntimeError):
    """A communication failure; ``code`` is the MPI error code, or -1."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


class StallError(CommError):
    """A collective did not complete within ``TNT_COMM_TIMEOUT`` seconds.

    The message names the collective (and bucket/tensors for the fused engine) and the
    ranks that never arrived. The job cannot continue: collectives can not be cancelled.
    """
