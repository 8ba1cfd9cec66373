"""The exact argv for each process starter; nothing is started."""

from __future__ import annotations

import pytest

from tnt_cli.commands import RankOptions, build_plan
from tnt_cli.hosts import Host, place_ranks
from tnt_cli.mpi import Flavour, Starter

PROG = ["/usr/bin/python3", "train.py", "-n", "3"]
WRAP = ["/py", "-m", "tnt_cli.rank", "--", *PROG]
ENV = {"TNT_LOG_LEVEL": "INFO", "A": "x y", "B": "b=c", "C": ""}
OMPI = Starter("/opt/ompi/bin/mpirun", Flavour.OPENMPI, "5.0.11")
MPICH = Starter("/opt/mpich/bin/mpiexec", Flavour.MPICH, "4.1.2")
INTEL = Starter("/opt/intel/bin/mpirun", Flavour.INTEL, "2021.10")
SRUN = Starter("/usr/bin/srun", Flavour.SLURM)


def test_wrapper_argv_forms() -> None:
    assert RankOptions().wrapper_argv(PROG, python="/py") == WRAP
    assert RankOptions(True, "cpu+mem").wrapper_argv(["p"], python="/py") == [
        "/py", "-m", "tnt_cli.rank", "--output", "all", "--numa", "cpu+mem", "--", "p"]


def test_openmpi_local() -> None:
    plan = build_plan(OMPI, place_ranks(None, 2, None, cores=8), ENV, WRAP, caller_env={})
    assert list(plan.argv) == [
        "/opt/ompi/bin/mpirun", "-n", "2", "--bind-to", "none",
        "-x", "TNT_LOG_LEVEL", "-x", "A", "-x", "B", "-x", "C", *WRAP]
    assert plan.env == ENV  # values travel in mpirun's environment, never in argv


def test_openmpi_root_and_oversubscription() -> None:
    placement = place_ranks(None, 4, None, cores=2)
    plan = build_plan(OMPI, placement, {}, WRAP, caller_env={}, as_root=True, oversubscribe=True)
    assert list(plan.argv) == [
        "/opt/ompi/bin/mpirun", "-n", "4", "--bind-to", "none", "--oversubscribe",
        "--allow-run-as-root", *WRAP]
    assert plan.notes == placement.notes and plan.notes


def test_openmpi_hosts_forward_basics() -> None:
    placement = place_ranks([Host("a", 2), Host("b", 1)], None, None)
    caller = {"PATH": "/bin", "LD_LIBRARY_PATH": "/lib", "HOME": "/root"}
    plan = build_plan(OMPI, placement, {"A": "1"}, WRAP, caller_env=caller)
    assert list(plan.argv) == [
        "/opt/ompi/bin/mpirun", "-n", "3", "--host", "a:2,b:1", "--bind-to", "none",
        "-x", "A", "-x", "PATH", "-x", "LD_LIBRARY_PATH", *WRAP]


def test_mpich_local_genv_pairs() -> None:
    plan = build_plan(MPICH, place_ranks(None, 3, None, cores=8), ENV, WRAP, caller_env={})
    assert list(plan.argv) == [
        "/opt/mpich/bin/mpiexec",
        "-genv", "TNT_LOG_LEVEL", "INFO", "-genv", "A", "x y", "-genv", "B", "b=c",
        "-genv", "C", "", "-n", "3", *WRAP]


def test_mpich_uniform_hosts_use_ppn() -> None:
    placement = place_ranks([Host("a"), Host("b")], None, 2)
    plan = build_plan(MPICH, placement, {}, WRAP, caller_env={})
    assert list(plan.argv) == [
        "/opt/mpich/bin/mpiexec", "-n", "4", "-hosts", "a,b", "-ppn", "2", *WRAP]


def test_mpich_uneven_hosts_use_argument_sets() -> None:
    placement = place_ranks([Host("a", 2), Host("b", 1)], 3, None)
    plan = build_plan(MPICH, placement, {"A": "1"}, WRAP, caller_env={})
    assert list(plan.argv) == [
        "/opt/mpich/bin/mpiexec", "-genv", "A", "1",
        "-n", "2", "-host", "a", *WRAP, ":", "-n", "1", "-host", "b", *WRAP]


def test_intel_like_mpich_and_turns_own_pinning_off_under_numactl() -> None:
    placement = place_ranks(None, 2, None, cores=8)
    plain = build_plan(INTEL, placement, {"A": "1"}, WRAP, caller_env={})
    assert list(plain.argv) == ["/opt/intel/bin/mpirun", "-genv", "A", "1", "-n", "2", *WRAP]
    pinned = build_plan(INTEL, placement, {"A": "1"}, WRAP, caller_env={}, numa_pinning=True)
    assert list(pinned.argv) == [
        "/opt/intel/bin/mpirun", "-genv", "A", "1", "-genv", "I_MPI_PIN", "0", "-n", "2", *WRAP]
    assert pinned.env["I_MPI_PIN"] == "0"


def test_mpich_does_not_touch_pinning() -> None:
    plan = build_plan(MPICH, place_ranks(None, 2, None, cores=8), {}, WRAP, caller_env={},
                      numa_pinning=True)
    assert "I_MPI_PIN" not in plan.argv


@pytest.mark.parametrize(
    ("n", "k", "extra"),
    [
        (None, None, []),
        (4, None, ["--ntasks=4"]),
        (None, 2, ["--ntasks-per-node=2"]),
        (8, 4, ["--ntasks=8", "--ntasks-per-node=4"]),
    ],
)
def test_srun(n, k, extra) -> None:
    plan = build_plan(SRUN, None, ENV, WRAP, caller_env={}, slurm_n=n, slurm_n_per_node=k)
    assert list(plan.argv) == [
        "/usr/bin/srun", "--kill-on-bad-exit=1", "--export=ALL", *extra, *WRAP]
    assert plan.env == ENV
