"""Single-process checks of the public surface (no mpirun: a 1-rank singleton job)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import tnt_comm as t


def test_version_and_exports() -> None:
    assert t.__version__ == "0.1.0"
    for name in t.__all__:
        assert hasattr(t, name), name
    assert issubclass(t.StallError, t.CommError)
    assert issubclass(t.CommError, RuntimeError)
    assert [o.name for o in t.Op] == ["SUM", "AVG", "MIN", "MAX"]


def test_tensor_spec_accepts_dtype_likes() -> None:
    assert t.TensorSpec("a", 3, "float32").dtype == np.dtype(np.float32)
    assert t.TensorSpec("a", 3, np.float64).nbytes == 24
    assert t.TensorSpec("a", 3, "bfloat16").dtype.name == "bfloat16"
    with pytest.raises(ValueError, match="count must be an int"):
        t.TensorSpec("a", 1.5, "float32")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_single_process_job_and_finalize() -> None:
    code = (
        "import numpy as np, tnt_comm as t\n"
        "assert not t.is_initialized()\n"
        "assert (t.rank(), t.size(), t.local_rank(), t.local_size()) == (0, 1, 0, 1)\n"
        "assert t.is_initialized()\n"
        "t.init()\n"  # idempotent
        "assert (t.allreduce(np.arange(3.0)) == np.arange(3.0)).all()\n"
        "assert (t.allreduce(np.arange(3.0), t.Op.AVG) == np.arange(3.0)).all()\n"
        "t.barrier()\n"
        "t.finalize(); t.finalize()\n"
        "try:\n"
        "    t.allreduce(np.ones(1))\n"
        "except t.CommError as e:\n"
        "    print('AFTER', e)\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "AFTER tnt_comm.finalize() was already called" in proc.stdout


def test_bad_timeout_variable_names_itself() -> None:
    proc = _python("import tnt_comm as t\nt.init()", TNT_COMM_TIMEOUT="soon")
    assert proc.returncode != 0
    assert "TNT_COMM_TIMEOUT='soon' is not a number > 0" in proc.stderr
    proc = _python("import tnt_comm as t\nt.init()", TNT_COMM_POLL_SPIN_US="-3")
    assert "TNT_COMM_POLL_SPIN_US='-3' is not a number >= 0" in proc.stderr
    proc = _python("import tnt_comm as t\nt.init()", TNT_COMM_WAIT_SPIN_US="long")
    assert "TNT_COMM_WAIT_SPIN_US='long' is not a number >= 0" in proc.stderr
    proc = _python("import tnt_comm as t\nt.init()", TNT_COMM_HANDOFF_SPIN_US="-1")
    assert "TNT_COMM_HANDOFF_SPIN_US='-1' is not a number >= 0" in proc.stderr


def test_mpi4py_initialised_first() -> None:
    code = (
        "from mpi4py import MPI\n"
        "import numpy as np, tnt_comm as t\n"
        "assert MPI.Query_thread() == MPI.THREAD_MULTIPLE\n"
        "print('SUM', t.allreduce(np.ones(2))[0], MPI.COMM_WORLD.allreduce(1))\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "SUM 1.0 1" in proc.stdout


def test_forked_child_gets_a_clear_error_not_a_hang() -> None:
    code = (
        "import os, numpy as np, tnt_comm as t\n"
        "t.allreduce(np.ones(1))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        t.allreduce(np.ones(1))\n"
        "        print('CHILD NO ERROR', flush=True)\n"
        "    except t.CommError as e:\n"
        "        print('CHILD', e, flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('PARENT', t.allreduce(np.ones(1))[0], flush=True)\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "CHILD NO ERROR" not in proc.stdout
    assert "CHILD tnt_comm was initialised in process" in proc.stdout, proc.stdout
    assert "forked child" in proc.stdout and "'spawn'" in proc.stdout
    assert "PARENT 1.0" in proc.stdout
