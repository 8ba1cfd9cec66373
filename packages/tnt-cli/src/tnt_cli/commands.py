"""Build the exact argument list for each process starter (no shell strings).

Every builder is a pure function: placement + environment + target in, argv out, so
each flavour's command is unit-tested without starting a process.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tnt_cli.hosts import Placement
from tnt_cli.mpi import Flavour, Starter

#: What remote hosts need to find the same Python and libraries (only names are sent).
REMOTE_BASICS = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV")


@dataclass(frozen=True)
class RankOptions:
    """What the per-rank wrapper (`python -m tnt_cli.rank`) does around the program."""

    output_on_all_devices: bool = False
    numa: str | None = None  # None, "cpu" or "cpu+mem"
    verbose: bool = False  # a failing rank's whole stderr tail, start-up noise included

    def wrapper_argv(self, target: Sequence[str], python: str | None = None) -> list[str]:
        argv = [python or sys.executable, "-m", "tnt_cli.rank"]
        if self.output_on_all_devices:
            argv += ["--output", "all"]
        if self.numa:
            argv += ["--numa", self.numa]
        if self.verbose:
            argv.append("--verbose")
        return [*argv, "--", *target]


@dataclass(frozen=True)
class LaunchPlan:
    """The starter's argv and the variables added to its environment."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def openmpi_command(
    starter: str,
    placement: Placement,
    rank_env: Mapping[str, str],
    rank_argv: Sequence[str],
    *,
    as_root: bool,
    oversubscribe: bool,
    forward: Sequence[str] = (),
) -> list[str]:
    """Open MPI 4 and 5 (PRRTE) `mpirun`.

    `--bind-to none`: Open MPI would bind each rank to one core (2 ranks or fewer) or
    one socket, which starves the framework's thread pools; the OS spreads ranks well,
    and `--pin-to-socket` pins by NUMA node explicitly. Variables travel by name
    (`-x NAME`, value read from mpirun's own environment), so values with spaces or
    `=` are never parsed by mpirun.
    """
    argv = [starter, "-n", str(placement.total)]
    if not placement.local:
        argv += ["--host", ",".join(f"{host}:{count}" for host, count in placement.counts)]
    argv += ["--bind-to", "none"]
    if oversubscribe:
        argv.append("--oversubscribe")
    if as_root:
        argv.append("--allow-run-as-root")
    for name in [*rank_env, *forward]:
        argv += ["-x", name]
    return [*argv, *rank_argv]


def hydra_command(
    starter: str,
    placement: Placement,
    rank_env: Mapping[str, str],
    rank_argv: Sequence[str],
    *,
    flavour: Flavour,
    numa_pinning: bool,
) -> list[str]:
    """MPICH's and Intel MPI's Hydra `mpiexec`/`mpirun`.

    Hydra forwards the whole environment by default; `-genv NAME VALUE` (two argv
    items) states our variables explicitly. Equal counts per host use `-hosts` and
    `-ppn`; unequal counts use one argument set per host (`-n k -host h prog :`).
    """
    argv = [starter]
    env = dict(rank_env)
    if flavour is Flavour.INTEL and numa_pinning:
        env["I_MPI_PIN"] = "0"  # numactl pins; Intel MPI's own pinning would fight it
    for name, value in env.items():
        argv += ["-genv", name, value]
    if placement.local:
        return [*argv, "-n", str(placement.total), *rank_argv]
    per_host = placement.uniform
    if per_host is not None:
        hosts = ",".join(host for host, _ in placement.counts)
        return [*argv, "-n", str(placement.total), "-hosts", hosts, "-ppn", str(per_host),
                *rank_argv]
    for i, (host, count) in enumerate(placement.counts):
        if i:
            argv.append(":")
        argv += ["-n", str(count), "-host", host, *rank_argv]
    return argv


def srun_command(
    starter: str, n: int | None, n_per_node: int | None, rank_argv: Sequence[str]
) -> list[str]:
    """Slurm's `srun` inside an allocation: the allocation decides the hosts.

    `--kill-on-bad-exit=1` stops the step when one task fails; `--export=ALL` sends
    the launcher's environment (our variables included) to every task.
    """
    argv = [starter, "--kill-on-bad-exit=1", "--export=ALL"]
    if n is not None:
        argv.append(f"--ntasks={n}")
    if n_per_node is not None:
        argv.append(f"--ntasks-per-node={n_per_node}")
    return [*argv, *rank_argv]


def build_plan(
    starter: Starter,
    placement: Placement | None,
    rank_env: Mapping[str, str],
    rank_argv: Sequence[str],
    *,
    caller_env: Mapping[str, str],
    as_root: bool = False,
    oversubscribe: bool = False,
    numa_pinning: bool = False,
    slurm_n: int | None = None,
    slurm_n_per_node: int | None = None,
) -> LaunchPlan:
    """Dispatch on the starter's flavour; `placement` is None only for srun."""
    env = dict(rank_env)
    if starter.flavour is Flavour.SLURM:
        argv = srun_command(starter.path, slurm_n, slurm_n_per_node, rank_argv)
        return LaunchPlan(tuple(argv), env)
    assert placement is not None, "mpirun needs a placement"
    notes, warnings = placement.notes, placement.warnings
    if starter.flavour is Flavour.OPENMPI:
        forward = [] if placement.local else [
            n for n in REMOTE_BASICS if n in caller_env and n not in env
        ]
        argv = openmpi_command(
            starter.path, placement, env, rank_argv,
            as_root=as_root, oversubscribe=oversubscribe, forward=forward,
        )
    else:
        argv = hydra_command(
            starter.path, placement, env, rank_argv,
            flavour=starter.flavour, numa_pinning=numa_pinning,
        )
        if starter.flavour is Flavour.INTEL and numa_pinning:
            env["I_MPI_PIN"] = "0"
    return LaunchPlan(tuple(argv), env, notes, warnings)
