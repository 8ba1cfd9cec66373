"""The `tarantella` / `tnt` command line (typer): options in, one launch out."""

from __future__ import annotations

import enum
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from tnt_cli import cleanup as cleanup_mod
from tnt_cli.commands import LaunchPlan, RankOptions, build_plan
from tnt_cli.envvars import Settings, new_job_id, parse_exports, rank_environment
from tnt_cli.errors import LaunchError, UsageError
from tnt_cli.gpus import count_gpus
from tnt_cli.hosts import is_oversubscribed_locally, place_ranks, read_hostfile
from tnt_cli.mpi import (
    Flavour,
    Starter,
    detect_starter,
    find_mpirun,
    find_srun,
    in_slurm_allocation,
)
from tnt_cli.numa import find_numactl, numa_nodes
from tnt_cli.output import StarterOutput
from tnt_cli.sessiondir import fresh_session_base
from tnt_cli.supervise import Outcome, run

PROG = "tarantella"

EPILOG = """Examples:

\b
  tarantella -n 4 -- train.py --epochs 3          4 processes on this machine
  tarantella -np 4 -m mypkg.train                 the same habits as mpirun / python -m
  tarantella --hostfile hosts --n-per-node 2 -- train.py
  tarantella -n 2 -x OMP_NUM_THREADS=1 --output-on-all-devices -- train.py
  tarantella -n 2 --python-interpreter "" -- ./a.out   run a binary directly
  tarantella --dry-run -n 8 -- train.py           print the command, start nothing
  tarantella --cleanup -- train.py                stop leftovers of train.py

Everything after `--` is the program and its arguments, untouched (a program flag
like `-n` is never read by the launcher)."""


class LogLevel(str, enum.Enum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class LauncherChoice(str, enum.Enum):
    auto = "auto"
    mpirun = "mpirun"
    srun = "srun"


_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}


def _say(level: str, message: str, threshold: str | None) -> None:
    """The launcher's own log line on stderr, shown from `--log-level` (default INFO)."""
    if _LEVELS[level] >= _LEVELS[threshold or "INFO"]:
        label = "" if level == "INFO" else f"{level.lower()}: "
        print(f"{PROG}: {label}{message}", file=sys.stderr, flush=True)


def _version_callback(value: bool) -> None:
    if value:
        from tnt_cli import __version__

        typer.echo(f"{PROG} (tnt-cli) {__version__}")
        raise typer.Exit()


app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,  # plain help: option texts hold brackets like '[rank]'
    pretty_exceptions_enable=False,
    no_args_is_help=False,
    help="Start PROGRAM on N processes (MPI ranks) on one or many hosts.",
)


@app.command(
    context_settings={
        "allow_extra_args": True,
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
    },
    epilog=EPILOG,
    options_metavar="[OPTIONS] -- PROGRAM [ARGS...]",
)
def launch(
    ctx: typer.Context,
    n: Annotated[
        int | None,
        typer.Option("-n", "-np", min=1, metavar="N",
                     help="Total number of processes (on this host unless --hostfile)."),
    ] = None,
    hostfile: Annotated[
        Path | None,
        typer.Option("--hostfile", metavar="FILE",
                     help="Hosts to run on: one per line, 'host' or 'host slots=K'."),
    ] = None,
    n_per_node: Annotated[
        int | None,
        typer.Option("--n-per-node", "--devices-per-node", min=1, metavar="K",
                     help="Processes on every host."),
    ] = None,
    no_gpu: Annotated[
        bool, typer.Option("--no-gpu", help="Run on CPUs only: no GPU is visible to the ranks.")
    ] = False,
    log_level: Annotated[
        LogLevel | None,
        typer.Option("--log-level", case_sensitive=False,
                     help="Log level of Tarantella (TNT_LOG_LEVEL) and of this launcher."),
    ] = None,
    log_on_all_devices: Annotated[
        bool, typer.Option("--log-on-all-devices", help="Tarantella logs on every rank.")
    ] = False,
    output_on_all_devices: Annotated[
        bool,
        typer.Option("--output-on-all-devices",
                     help="Show stdout/stderr of every rank, each line prefixed '[rank] ' "
                          "(default: the master rank's only; a failing rank's error is "
                          "always shown)."),
    ] = False,
    exports: Annotated[
        list[str] | None,
        typer.Option("-x", metavar="NAME=VALUE",
                     help="Set NAME=VALUE on every rank (repeatable, in order)."),
    ] = None,
    fusion_threshold: Annotated[
        int | None,
        typer.Option("--fusion-threshold", min=0, metavar="KB",
                     help="Gradient fusion bucket size in KB (TNT_FUSION_THRESHOLD; "
                          "0: one allreduce per tensor)."),
    ] = None,
    pin_to_socket: Annotated[
        bool, typer.Option("--pin-to-socket",
                           help="Pin each rank's CPUs to one NUMA node (numactl), by local rank.")
    ] = False,
    pin_memory_to_socket: Annotated[
        bool, typer.Option("--pin-memory-to-socket",
                           help="Like --pin-to-socket, and allocate memory on that node too.")
    ] = False,
    module: Annotated[
        str | None,
        typer.Option("-m", metavar="MODULE",
                     help="Run a Python module as the program (like python -m); "
                          "its arguments follow, after --."),
    ] = None,
    python_interpreter: Annotated[
        str | None,
        typer.Option("--python-interpreter", metavar="CMD",
                     help="Interpreter for PROGRAM, e.g. \"python -X dev\" (default: the "
                          "Python running this launcher); \"\" runs PROGRAM as a binary."),
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v",
                           help="Also show the MPI starter's own messages, the starter "
                                "command, and a failing rank's whole stderr tail.")
    ] = False,
    launcher: Annotated[
        LauncherChoice,
        typer.Option("--launcher", case_sensitive=False,
                     help="Process starter: srun inside a Slurm allocation, else mpirun."),
    ] = LauncherChoice.auto,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the exact command and environment; start nothing.")
    ] = False,
    cleanup: Annotated[
        bool, typer.Option("--cleanup",
                           help="Stop leftover processes of PROGRAM (on every host of --hostfile).")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="With --cleanup: SIGKILL instead of SIGTERM.")
    ] = False,
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_version_callback, is_eager=True,
                     help="Print the version and exit."),
    ] = None,
) -> None:
    """Start PROGRAM on N processes (MPI ranks), on this host or on the hosts of a hostfile.

    PROGRAM runs under the Python interpreter (see --python-interpreter) through the
    MPI in use (mpirun/mpiexec of Open MPI, MPICH or Intel MPI), or srun inside a
    Slurm allocation. Exit code: 0 when every rank succeeded, else non-zero.
    """
    level = log_level.value if log_level else None
    if verbose and level is None:
        level = "DEBUG"
    program = ["-m", module, *ctx.args] if module is not None else list(ctx.args)
    try:
        code = _launch(
            program=program,
            n=n, hostfile=hostfile, n_per_node=n_per_node, no_gpu=no_gpu,
            settings=Settings(
                log_level=level, log_on_all_devices=log_on_all_devices,
                output_on_all_devices=output_on_all_devices,
                fusion_threshold_kb=fusion_threshold, no_gpu=no_gpu,
            ),
            exports=exports or [], pin=_pin_mode(pin_to_socket, pin_memory_to_socket),
            python_interpreter=python_interpreter, launcher=launcher.value,
            dry_run=dry_run, cleanup=cleanup, force=force, verbose=verbose,
        )
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(exc.exit_code) from None
    if code:
        raise typer.Exit(code)


def _pin_mode(pin_to_socket: bool, pin_memory_to_socket: bool) -> str | None:
    if pin_memory_to_socket:
        return "cpu+mem"
    return "cpu" if pin_to_socket else None


def _interpreter(spec: str | None) -> list[str]:
    """`--python-interpreter` as argv; default: the Python running the launcher.

    Why not `python` on PATH: `/venv/bin/tarantella` started outside an activated venv
    would then run the program under another Python, without the venv's packages
    (torchrun and `python -m` users expect the launcher's own interpreter).
    """
    if spec is None:
        return [sys.executable]
    words = shlex.split(spec)
    if not words:
        return []
    found = shutil.which(words[0])
    if found is None:
        raise UsageError(f"--python-interpreter: {words[0]!r} not found on PATH")
    return [found, *words[1:]]


def _check_program(program: Sequence[str], interpreter: Sequence[str]) -> None:
    if not program:
        raise UsageError(f"no program given; usage: {PROG} [OPTIONS] -- PROGRAM [ARGS...]")
    first = program[0]
    if interpreter:
        if not first.startswith("-") and not Path(first).is_file():
            raise UsageError(f"program {first!r} not found (no such file)")
    elif shutil.which(first) is None:
        raise UsageError(f"program {first!r} not found or not executable")


def _choose_starter(launcher: str, hostfile: Path | None) -> Starter:
    use_srun = launcher == "srun" or (
        launcher == "auto" and hostfile is None and in_slurm_allocation()
    )
    if use_srun:
        if hostfile is not None:
            raise UsageError("--launcher srun conflicts with --hostfile (Slurm picks the hosts)")
        if not in_slurm_allocation():
            raise UsageError("--launcher srun needs a Slurm allocation (SLURM_JOB_ID not set)")
        return Starter(find_srun(), Flavour.SLURM)
    return detect_starter(find_mpirun())


def _launch(
    *, program: list[str], n: int | None, hostfile: Path | None, n_per_node: int | None,
    no_gpu: bool, settings: Settings, exports: list[str], pin: str | None,
    python_interpreter: str | None, launcher: str, dry_run: bool, cleanup: bool, force: bool,
    verbose: bool = False,
) -> int:
    if force and not cleanup:
        raise UsageError("--force only works with --cleanup")
    if cleanup:
        return _cleanup(program, hostfile, force, dry_run, launcher)
    interpreter = _interpreter(python_interpreter)
    _check_program(program, interpreter)
    rank_env = rank_environment(settings, parse_exports(exports), os.environ, new_job_id())
    hosts = read_hostfile(hostfile) if hostfile is not None else None
    starter = _choose_starter(launcher, hostfile)
    threshold = settings.log_level
    if pin is not None and hosts is None:
        find_numactl()  # fail here, before any rank starts, when pinning cannot work
        numa_nodes()
    rank_argv = RankOptions(settings.output_on_all_devices, pin, verbose).wrapper_argv(
        [*interpreter, *program]
    )
    plan = _plan(starter, hosts, n, n_per_node, no_gpu, rank_env, rank_argv, pin)
    for message in plan.warnings:
        _say("WARNING", message, threshold)
    for message in plan.notes:
        _say("INFO", message, threshold)
    if dry_run:
        _print_dry_run(plan, starter)
        return 0
    _say("DEBUG", f"{starter.flavour.value} {starter.version}: {shlex.join(plan.argv)}", threshold)
    output = StarterOutput(sys.stderr.buffer, verbose=verbose, out_sink=sys.stdout.buffer)
    if starter.flavour is Flavour.OPENMPI and hosts is None:
        with fresh_session_base(os.environ) as base_env:
            outcome = run(plan.argv, {**plan.env, **base_env}, output)
    else:
        outcome = run(plan.argv, plan.env, output)
    return _report(outcome, output, threshold)


def _report(outcome: Outcome, output: StarterOutput, threshold: str | None) -> int:
    """The launcher's last word on the job, and its exit code."""
    if outcome.interrupted_by is not None:
        name = signal.Signals(outcome.interrupted_by).name
        _say("ERROR", f"stopped by {name}; all ranks were stopped", threshold)
        return outcome.code
    code = outcome.code
    if code == 0 and output.failure is not None:
        code = 1  # e.g. Open MPI ends 0 after losing a host's daemon
    if outcome.stopped_after_failure:
        _say("ERROR", f"the MPI starter had not ended {outcome.failure_grace_s:.0f} s after "
             f"the failure ({output.failure}), so it was stopped; a host may be unreachable: "
             "processes left on other hosts can be stopped with "
             "'tarantella --cleanup --hostfile FILE -- PROGRAM'", threshold)
    if code:
        output.explain()
        where = ("the failing rank's error is shown above" if output.rank_error_shown
                 else f"cause: {output.failure or 'see above'}")
        hidden = (f"; {output.hidden_count} message(s) of the MPI starter hidden "
                  "(--verbose shows them)" if output.hidden_count else "")
        _say("ERROR", f"the job failed (exit code {code}); {where}{hidden}", threshold)
    return code


def _plan(
    starter: Starter, hosts: list | None, n: int | None, n_per_node: int | None, no_gpu: bool,
    rank_env: dict[str, str], rank_argv: list[str], pin: str | None,
) -> LaunchPlan:
    if starter.flavour is Flavour.SLURM:
        return build_plan(starter, None, rank_env, rank_argv, caller_env=os.environ,
                          slurm_n=n, slurm_n_per_node=n_per_node)
    gpus = 0 if no_gpu else count_gpus()
    placement = place_ranks(hosts, n, n_per_node, gpus_per_node=gpus)
    return build_plan(
        starter, placement, rank_env, rank_argv, caller_env=os.environ,
        as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
        oversubscribe=is_oversubscribed_locally(placement),
        numa_pinning=pin is not None,
    )


def _print_dry_run(plan: LaunchPlan, starter: Starter) -> None:
    """A copy-pasteable shell command: the added variables, then the argv."""
    print(f"# {starter.flavour.value} {starter.version}".rstrip())
    for name, value in plan.env.items():
        print(f"{name}={shlex.quote(value)} \\")
    print(shlex.join(plan.argv))


def _cleanup(
    program: list[str], hostfile: Path | None, force: bool, dry_run: bool, launcher: str
) -> int:
    if len(program) != 1:
        raise UsageError(f"--cleanup takes exactly one PROGRAM after --: {PROG} --cleanup -- PROGRAM")
    if hostfile is None:
        return cleanup_mod.cleanup(program[0], force=force, dry_run=dry_run)
    hosts = read_hostfile(hostfile)
    starter = _choose_starter(launcher, hostfile)
    flags = [*(["--force"] if force else []), *(["--dry-run"] if dry_run else [])]
    target = [sys.executable, "-m", "tnt_cli.cleanup", *flags, program[0]]
    rank_argv = RankOptions(output_on_all_devices=True).wrapper_argv(target)
    placement = place_ranks(hosts, None, 1)
    plan = build_plan(starter, placement, {}, rank_argv, caller_env=os.environ,
                      as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
    return run(plan.argv, plan.env).code


def _is_click_error(exc: BaseException) -> bool:
    """Click's usage errors (typer may vendor click, so test the shape, not the class)."""
    return callable(getattr(exc, "format_message", None)) and isinstance(
        getattr(exc, "exit_code", None), int
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; usage errors are one line and exit code 2."""
    command = typer.main.get_command(app)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        result = command.main(args=args, prog_name=PROG, standalone_mode=False)
    except Exception as exc:
        if not _is_click_error(exc):
            raise
        message = " ".join(exc.format_message().split())  # type: ignore[attr-defined]
        print(f"{PROG}: error: {message} (see '{PROG} --help')", file=sys.stderr, flush=True)
        return int(exc.exit_code)  # type: ignore[attr-defined]
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
