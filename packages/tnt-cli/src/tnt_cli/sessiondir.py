"""A fresh session-directory base for every local Open MPI job.

Open MPI's starter keeps its session directory (PMIx rendezvous sockets, shared-memory
segments) in ``$TMPDIR/ompi.<starter pid>``. A starter that is killed (SIGKILL, a lost
test) leaves that directory behind, and where the pid range is small (``pid_max`` 32768
is common in containers) the pid comes round again: the new starter finds the stale
directory and fails at start-up with "The PMIx server's listener thread failed to
start". Giving each launch its own base, removed when the job has ended, makes a stale
directory of an earlier job unreachable, whatever its pid.

Only local jobs get one: on other hosts the daemons would be told a base that exists
only here.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

#: Open MPI 5 (PRRTE) and Open MPI 4 (ORTE) read their session directory's base from these.
BASE_VARIABLES = ("PRTE_MCA_prte_tmpdir_base", "OMPI_MCA_orte_tmpdir_base")


@contextmanager
def fresh_session_base(caller_env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """Yield the variables that point the starter at a new, empty base directory; the
    directory (and whatever the job left in it) is removed afterwards. A base the caller
    set already is kept as it is (nothing is added)."""
    if any(name in caller_env for name in BASE_VARIABLES):
        yield {}
        return
    base = tempfile.mkdtemp(prefix="tarantella-mpi-")
    try:
        yield {name: base for name in BASE_VARIABLES}
    finally:
        shutil.rmtree(base, ignore_errors=True)

