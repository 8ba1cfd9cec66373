"""The command line: options to command and environment (dry runs), and usage errors."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import write_executable
from typer.testing import CliRunner

from tnt_cli import __version__, app, main

pytestmark = pytest.mark.usefixtures("clean_env")

RUNNER = CliRunner()
ROOT = ["--allow-run-as-root"] if os.geteuid() == 0 else []
PY = sys.executable


@pytest.fixture
def prog(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


def dry(args: list[str]) -> tuple[list[str], dict[str, str], str]:
    """Run a dry run; return the starter argv, the environment lines, and stderr.

    The job id every launch adds (last) is checked here and left out of the result.
    """
    result = RUNNER.invoke(app, ["--dry-run", *args])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("# ")
    env = {}
    for line in lines[1:-1]:
        assert line.endswith(" \\")
        name, _, value = line[:-2].partition("=")
        env[name] = shlex.split(value)[0] if value else ""
    argv = shlex.split(lines[-1])
    assert list(env)[-1] == "TARANTELLA_JOB_ID" and env.pop("TARANTELLA_JOB_ID").count("-") >= 2
    for form in (["-x", "TARANTELLA_JOB_ID"], ["-genv", "TARANTELLA_JOB_ID"]):
        if form[0] in argv:
            at = next(i for i in range(len(argv)) if argv[i:i + 2] == form)
            del argv[at:at + (2 if form[0] == "-x" else 3)]
    return argv, env, result.stderr


def test_program_flag_colliding_with_launcher_flag(fake_mpirun, prog: str) -> None:
    mpirun = str(fake_mpirun("openmpi5"))
    argv, env, _ = dry(["-n", "2", "--", prog, "-n", "5", "--dry-run"])
    assert argv == [mpirun, "-n", "2", "--bind-to", "none", *ROOT,
                    PY, "-m", "tnt_cli.rank", "--", PY, prog, "-n", "5", "--dry-run"]
    assert env == {}


def test_program_without_double_dash_stops_option_parsing(fake_mpirun, prog: str) -> None:
    fake_mpirun("openmpi5")
    argv, _, _ = dry(["-n", "2", prog, "-n", "7"])
    assert argv[-3:] == [prog, "-n", "7"]
    assert argv[1:3] == ["-n", "2"]


def test_exports_settings_and_pass_through(fake_mpirun, prog: str, monkeypatch) -> None:
    fake_mpirun("openmpi5")
    monkeypatch.setenv("TNT_COMM_TIMEOUT", "30")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("UNRELATED", "1")
    argv, env, _ = dry([
        "-n", "2", "--log-level", "debug", "--log-on-all-devices", "--output-on-all-devices",
        "--fusion-threshold", "128", "--no-gpu",
        "-x", "A=1", "-x", "B=", "-x", "C=x y", "-x", "D=b=c", "--", prog,
    ])
    assert list(env.items()) == [
        ("TNT_COMM_TIMEOUT", "30"), ("TF_CPP_MIN_LOG_LEVEL", "2"),
        ("TNT_FUSION_THRESHOLD", "128"), ("TNT_LOG_LEVEL", "DEBUG"),
        ("TNT_LOG_ON_ALL_DEVICES", "1"), ("TNT_OUTPUT_ON_ALL_DEVICES", "1"),
        ("CUDA_VISIBLE_DEVICES", ""),
        ("A", "1"), ("B", ""), ("C", "x y"), ("D", "b=c"),
    ]
    exported = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    assert exported == list(env)
    assert argv[argv.index("tnt_cli.rank") + 1: argv.index("tnt_cli.rank") + 4] == [
        "--output", "all", "--"]


@pytest.mark.parametrize(
    ("kind", "expected_head"),
    [
        ("mpich", ["-genv", "A", "x y", "-n", "3"]),
        ("intel", ["-genv", "A", "x y", "-n", "3"]),
        ("openmpi4", ["-n", "3", "--bind-to", "none", "--oversubscribe", *ROOT, "-x", "A"]),
    ],
)
def test_each_flavour_from_its_version_text(fake_mpirun, prog, kind, expected_head) -> None:
    mpirun = str(fake_mpirun(kind))
    argv, env, stderr = dry(["-n", "3", "-x", "A=x y", "--", prog])
    assert argv[0] == mpirun
    assert argv[1:1 + len(expected_head)] == expected_head
    assert env == {"A": "x y"}
    assert ("3 processes on" in stderr and "oversubscribing" in stderr) == (
        len(os.sched_getaffinity(0)) < 3
    )
    assert ("--oversubscribe" in argv) == (kind == "openmpi4" and len(os.sched_getaffinity(0)) < 3)


def test_hostfile(fake_mpirun, prog, tmp_path: Path) -> None:
    fake_mpirun("openmpi5")
    hosts = tmp_path / "hosts"
    hosts.write_text("n1 slots=2\nn2 slots=2\n")
    argv, _, _ = dry(["--hostfile", str(hosts), "--", prog])
    assert argv[1:5] == ["-n", "4", "--host", "n1:2,n2:2"]
    argv, _, _ = dry(["--hostfile", str(hosts), "--devices-per-node", "1", "--", prog])
    assert argv[1:5] == ["-n", "2", "--host", "n1:1,n2:1"]


def test_one_rank_per_gpu_without_n(fake_mpirun, prog, monkeypatch) -> None:
    fake_mpirun("openmpi5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    argv, _, stderr = dry(["--", prog])
    assert argv[1:3] == ["-n", "3"] and "one process per host" not in stderr
    argv, env, stderr = dry(["--no-gpu", "--", prog])
    assert argv[1:3] == ["-n", "1"] and env["CUDA_VISIBLE_DEVICES"] == ""
    assert "warning: no -n or --n-per-node given and no GPU found" in stderr


def test_python_interpreter_forms(fake_mpirun, prog, tmp_path: Path) -> None:
    fake_mpirun("openmpi5")
    argv, _, _ = dry(["-n", "1", "--python-interpreter", f"{PY} -X dev", "--", prog, "a"])
    assert argv[argv.index("--") + 1:] == [PY, "-X", "dev", prog, "a"]
    binary = write_executable(tmp_path / "tool", "#!/bin/sh\necho hi\n")
    argv, _, _ = dry(["-n", "1", "--python-interpreter", "", "--", str(binary), "-v"])
    assert argv[argv.index("--") + 1:] == [str(binary), "-v"]


def test_python_module_program_is_not_checked_as_file(fake_mpirun) -> None:
    fake_mpirun("openmpi5")
    argv, _, _ = dry(["-n", "1", "--", "-m", "json.tool", "-h"])
    assert argv[-3:] == ["-m", "json.tool", "-h"]


def test_slurm_allocation_uses_srun(prog, tmp_path: Path, monkeypatch) -> None:
    bindir = tmp_path / "slurm-bin"
    bindir.mkdir()
    srun = write_executable(bindir / "srun", "#!/bin/sh\nexit 99\n")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    argv, env, _ = dry(["-n", "8", "--n-per-node", "4", "-x", "A=1", "--", prog])
    assert argv[:5] == [str(srun), "--kill-on-bad-exit=1", "--export=ALL", "--ntasks=8",
                        "--ntasks-per-node=4"]
    assert argv[5:8] == [PY, "-m", "tnt_cli.rank"]
    assert env == {"A": "1"}


def test_pin_to_socket_with_numactl(fake_mpirun, prog, tmp_path: Path, monkeypatch) -> None:
    if not list(Path("/sys/devices/system/node").glob("node[0-9]*")):
        pytest.skip("this machine exposes no NUMA nodes in sysfs")
    fake_mpirun("openmpi5")
    bindir = tmp_path / "numa-bin"
    bindir.mkdir()
    write_executable(bindir / "numactl", "#!/bin/sh\nexec \"$@\"\n")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    argv, _, _ = dry(["-n", "2", "--pin-memory-to-socket", "--", prog])
    assert argv[argv.index("tnt_cli.rank") + 1:][:3] == ["--numa", "cpu+mem", "--"]


def test_pin_to_socket_without_numactl_is_a_clear_error(fake_mpirun, prog, tmp_path, monkeypatch):
    fake_mpirun("openmpi5")
    monkeypatch.setenv("PATH", str(tmp_path))
    result = RUNNER.invoke(app, ["-n", "2", "--pin-to-socket", "--", prog])
    assert result.exit_code == 1
    assert "need numactl, which is not on PATH" in result.stderr


def test_version() -> None:
    result = RUNNER.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"tarantella (tnt-cli) {__version__}\n"


def test_help_lists_options_and_examples() -> None:
    result = RUNNER.invoke(app, ["--help"])
    assert result.exit_code == 0
    for option in ("--hostfile", "--n-per-node", "--devices-per-node", "--no-gpu", "--log-level",
                   "--log-on-all-devices", "--output-on-all-devices", "--fusion-threshold",
                   "--pin-to-socket", "--pin-memory-to-socket", "--dry-run", "--cleanup",
                   "--force", "--version", "--python-interpreter", "-x"):
        assert option in result.stdout, option
    assert "tarantella -n 4 -- train.py" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus", "--", "PROG"], "No such option: --bogus"),
        (["-n", "0", "--", "PROG"], "Invalid value for '-n'"),
        (["-n", "x", "--", "PROG"], "Invalid value for '-n'"),
        (["-n", "2"], "no program given"),
        (["-n", "2", "--", "missing.py"], "program 'missing.py' not found"),
        (["-n", "2", "-x", "A", "--", "PROG"], "-x A: a value is required"),
        (["-n", "2", "-x", "TNT_LOG_LEVEL=INFO", "--log-level", "INFO", "--", "PROG"],
         "conflicts with the launcher option"),
        (["-n", "3", "--n-per-node", "2", "--", "PROG"], "-n 3 conflicts with --n-per-node 2"),
        (["--force", "--", "PROG"], "--force only works with --cleanup"),
        (["--hostfile", "/nonexistent/hosts", "--", "PROG"], "cannot read hostfile"),
        (["--log-level", "LOUD", "--", "PROG"], "Invalid value for '--log-level'"),
        (["--launcher", "srun", "--", "PROG"], "--launcher srun needs a Slurm allocation"),
        (["--python-interpreter", "nopython3x", "--", "PROG"], "'nopython3x' not found"),
        (["--cleanup", "--", "a", "b"], "--cleanup takes exactly one PROGRAM"),
    ],
)
def test_usage_errors_are_one_line_exit_2(fake_mpirun, prog, capsys, args, message) -> None:
    fake_mpirun("openmpi5")
    args = [prog if a == "PROG" else a for a in args]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("tarantella: error: ")
    assert message in lines[0]


def test_console_scripts_installed() -> None:
    bindir = Path(sys.executable).parent
    for name in ("tarantella", "tnt"):
        done = subprocess.run([str(bindir / name), "--version"], capture_output=True, text=True,
                              timeout=60, check=False)
        assert (done.returncode, done.stdout) == (0, f"tarantella (tnt-cli) {__version__}\n")
    done = subprocess.run([sys.executable, "-m", "tnt_cli", "--bogus"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.startswith("tarantella: error: No such option: --bogus")


def test_np_is_n_and_module_works_before_double_dash(fake_mpirun, prog) -> None:
    """mpirun's `-np` and python's `-m MODULE` (before `--`; its arguments after `--`)."""
    fake_mpirun("openmpi5")
    argv, _, _ = dry(["-np", "2", "--", prog])
    assert argv[1:3] == ["-n", "2"]
    argv, _, _ = dry(["-np", "3", "-m", "json.tool", "--", "-n", "5"])
    assert argv[1:3] == ["-n", "3"]
    assert argv[argv.index("--") + 1:] == [PY, "-m", "json.tool", "-n", "5"]
    assert dry(["-n", "1", "-m", "json.tool"])[0][-3:] == [PY, "-m", "json.tool"]


def test_default_interpreter_ignores_python_on_path(fake_mpirun, prog, tmp_path, monkeypatch):
    fake_mpirun("openmpi5")
    write_executable(tmp_path / "python", "#!/bin/sh\nexit 9\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    argv, _, _ = dry(["-n", "1", "--", prog])
    assert argv[argv.index("--") + 1:] == [PY, prog]


def test_only_tensorflows_tf_variables_pass_through(fake_mpirun, prog, monkeypatch) -> None:
    fake_mpirun("openmpi5")
    for name, value in [("TF_CLI_CONFIG_FILE", "/home/u/.terraformrc"), ("TF_CONFIG", "{}"),
                        ("TF_CPP_MIN_LOG_LEVEL", "1"), ("TF_DETERMINISTIC_OPS", "1"),
                        ("TF_XLA_FLAGS", "--tf_xla_auto_jit=2"), ("TF_WORKSPACE", "prod")]:
        monkeypatch.setenv(name, value)
    _, env, _ = dry(["-n", "2", "-x", "TF_WORKSPACE=dev", "--", prog])
    assert env == {"TF_CPP_MIN_LOG_LEVEL": "1", "TF_DETERMINISTIC_OPS": "1",
                   "TF_XLA_FLAGS": "--tf_xla_auto_jit=2", "TF_WORKSPACE": "dev"}


def test_job_id_cannot_be_set_with_x(fake_mpirun, prog, capsys) -> None:
    fake_mpirun("openmpi5")
    assert main(["-n", "2", "-x", "TARANTELLA_JOB_ID=mine", "--", prog]) == 2
    assert "the launcher sets TARANTELLA_JOB_ID itself" in capsys.readouterr().err
