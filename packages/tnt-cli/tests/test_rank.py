"""The per-rank wrapper: rank detection, hidden ranks' failure reports, prefixing, exec."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import write_executable

from tnt_cli.errors import EnvironmentProblem
from tnt_cli.numa import find_numactl, numa_nodes, numactl_prefix
from tnt_cli.rank import TAIL_LINES, local_rank_from_env, rank_from_env, run_hidden, run_prefixed

PY = sys.executable


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({"OMPI_COMM_WORLD_RANK": "3", "SLURM_PROCID": "0"}, 3),  # mpirun inside sbatch
        ({"PMIX_RANK": "4"}, 4),
        ({"PMI_RANK": "2", "SLURM_PROCID": "1"}, 2),  # Hydra inside Slurm
        ({"SLURM_PROCID": "5"}, 5),
        ({}, 0),  # plain `python program.py`: one rank
    ],
)
def test_rank_from_env(env: dict[str, str], rank: int) -> None:
    assert rank_from_env(env) == rank


def test_local_rank_from_env() -> None:
    assert local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "SLURM_LOCALID": "0"}) == 1
    assert local_rank_from_env({"MPI_LOCALRANKID": "2"}) == 2
    assert local_rank_from_env({}) == 0


def test_hidden_rank_failure_prints_the_tail_of_stderr() -> None:
    code = f"""
import sys
print("to stdout, never shown")
for i in range({TAIL_LINES + 50}):
    print("line", i, file=sys.stderr)
sys.exit(4)
"""
    err = io.BytesIO()
    assert run_hidden([PY, "-c", code], rank=3, err=err) == 4
    lines = err.getvalue().decode().splitlines()
    assert lines[0] == "[3] tarantella: rank 3 failed with exit code 4; the end of its stderr:"
    assert lines[1:] == [f"[3] line {i}" for i in range(50, TAIL_LINES + 50)]


def test_hidden_rank_success_prints_nothing() -> None:
    err = io.BytesIO()
    code = "import sys; print('x'); print('warning', file=sys.stderr)"
    assert run_hidden([PY, "-c", code], rank=1, err=err) == 0
    assert err.getvalue() == b""


def test_hidden_rank_killed_by_signal() -> None:
    err = io.BytesIO()
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert run_hidden([PY, "-c", code], rank=1, err=err) == 128 + 9
    assert b"[1] tarantella: rank 1 was killed by signal SIGKILL" in err.getvalue()


def _signalled_while_aborting(error: str) -> bytes:
    """A rank that prints a traceback and is then signalled by its starter (what MPI_Abort
    does: the starter kills every rank, the aborting one included, before it exits)."""
    code = f"""
import os, signal, sys, time, traceback
try:
    raise {error}
except BaseException:
    traceback.print_exc()
sys.stderr.flush()
os.kill(os.getppid(), signal.SIGTERM)  # the starter's kill reaches the wrapper first
time.sleep(30)
"""
    err = io.BytesIO()
    assert run_hidden([PY, "-c", code], rank=1, err=err) == 128 + signal.SIGTERM
    return err.getvalue()


def test_hidden_rank_that_aborts_the_job_shows_its_traceback_although_signalled() -> None:
    shown = _signalled_while_aborting("RuntimeError('injected on rank 1')")
    assert b"[1] RuntimeError: injected on rank 1" in shown


def test_hidden_rank_stopped_by_a_forwarded_ctrl_c_stays_quiet() -> None:
    assert _signalled_while_aborting("KeyboardInterrupt()") == b""


def test_prefixed_output_keeps_streams_apart_and_ends_partial_lines() -> None:
    out, err = io.BytesIO(), io.BytesIO()
    code = "import sys; sys.stdout.write('a\\nb'); sys.stderr.write('e\\n'); sys.exit(2)"
    assert run_prefixed([PY, "-c", code], rank=7, out=out, err=err) == 2
    assert out.getvalue() == b"[7] a\n[7] b\n"
    assert err.getvalue() == b"[7] e\n"


def _wrapper(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK")}
    return subprocess.run([PY, "-m", "tnt_cli.rank", *args], env={**full, **env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_wrapper_master_becomes_the_program() -> None:
    """Rank 0 execs: the program runs in the wrapper's own process."""
    proc = subprocess.Popen([PY, "-m", "tnt_cli.rank", "--", PY, "-c", "import os; print(os.getpid())"],
                            env={**os.environ, "PMI_RANK": "0"}, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert int(out) == proc.pid


def test_wrapper_hydra_style_rank_fails_with_report() -> None:
    done = _wrapper(["--", PY, "-c", "print('hidden'); raise SystemExit('bad input on rank')"],
                    {"PMI_RANK": "1"})
    assert done.returncode == 1
    assert done.stdout == ""
    assert "[1] bad input on rank" in done.stderr


def test_wrapper_missing_program() -> None:
    done = _wrapper(["--", "/nonexistent/prog"], {"PMI_RANK": "0"})
    assert done.returncode == 127
    assert "[0] tarantella: cannot start '/nonexistent/prog'" in done.stderr


def test_wrapper_numa_without_numactl(tmp_path: Path) -> None:
    done = _wrapper(["--numa", "cpu", "--", PY, "-c", "pass"], {"PMI_RANK": "1", "PATH": str(tmp_path)})
    assert done.returncode == 1
    assert "[1] tarantella: --pin-to-socket/--pin-memory-to-socket need numactl" in done.stderr


def test_numactl_prefix_round_robin_by_local_rank() -> None:
    assert numactl_prefix(0, "cpu", "/n", [0, 1]) == ["/n", "--cpunodebind=0"]
    assert numactl_prefix(3, "cpu+mem", "/n", [0, 1]) == ["/n", "--cpunodebind=1", "--membind=1"]
    assert numactl_prefix(2, "cpu", "/n", [0, 2, 4]) == ["/n", "--cpunodebind=4"]


def test_numa_nodes_from_sysfs(tmp_path: Path) -> None:
    for name in ("node1", "node0", "possible", "has_cpu"):
        (tmp_path / name).mkdir()
    assert numa_nodes(tmp_path) == [0, 1]
    with pytest.raises(EnvironmentProblem, match="needs NUMA information"):
        numa_nodes(tmp_path / "missing")


def test_find_numactl(tmp_path: Path) -> None:
    fake = write_executable(tmp_path / "numactl", "#!/bin/sh\n")
    assert find_numactl(str(tmp_path)) == str(fake)
    with pytest.raises(EnvironmentProblem, match="apt-get install numactl"):
        find_numactl(str(tmp_path / "none"))


def test_wrapper_numa_runs_through_numactl(tmp_path: Path) -> None:
    if not list(Path("/sys/devices/system/node").glob("node[0-9]*")):
        pytest.skip("this machine exposes no NUMA nodes in sysfs")
    write_executable(tmp_path / "numactl", "#!/bin/sh\necho \"numactl $1 $2\"\nshift 2\nexec \"$@\"\n")
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    done = _wrapper(["--output", "all", "--numa", "cpu+mem", "--", PY, "-c", "print('ran')"],
                    {"PMI_RANK": "0", "PATH": path})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[0] numactl --cpunodebind=0 --membind=0", "[0] ran"]


def test_wrapper_does_not_import_typer() -> None:
    """Every rank starts the wrapper: it must stay light (no CLI framework import)."""
    done = subprocess.run([PY, "-c", "import sys, tnt_cli.rank; print('typer' in sys.modules)"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"
