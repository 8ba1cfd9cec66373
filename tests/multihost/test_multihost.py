"""Jobs whose ranks live on different "hosts" (network namespaces) and talk over TCP.

Every test really launches `tarantella --hostfile` on host1; Open MPI reaches host2 and
host3 through the bed's rsh agent. Communication-only jobs (jobs/steps.py, no
TensorFlow) cover placement, environment, output and failures; one TensorFlow job per
layout checks serial equivalence. Times are deadlines, and are reported at the end.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import testbed
from conftest import JOBS, TARANTELLA, job_env, record, start_job

pytestmark = pytest.mark.usefixtures("bed")

STEPS = str(JOBS / "steps.py")
PY = ["--python-interpreter", sys.executable]


#: Open MPI's own start-up failure, seen once in ~20 CI runs of the bed (session 13): the
#: launch never reached tarantella's code. Such a launch is retried once and reported.
PMIX_START_FAILURE = "The PMIx server's listener thread failed to start"


def _report_job(bed, tmp_path: Path, hostfile: Path, layout: list[str], *extra: str) -> dict:
    args = ["--hostfile", str(hostfile), *layout, *PY, *extra, "--",
            STEPS, "--out", str(tmp_path), "--scenario", "report"]
    job = start_job(bed, tmp_path, args)
    if job.wait(120) != 0 and PMIX_START_FAILURE in job.stderr:
        record(f"{hostfile.name}: Open MPI's PMIx server did not start; launched once more", None, None)
        job = start_job(bed, tmp_path, args)
    assert job.wait(120) == 0, job.output()
    result = json.loads((tmp_path / "result.json").read_text())
    result["stdout"] = job.stdout
    return result


def _placement(result: dict) -> list[tuple[int, int, int, int, str]]:
    return [(r["rank"], r["size"], r["local_rank"], r["local_size"], r["host"])
            for r in result["ranks"]]


def _switch_bytes(bed, host: str) -> int:
    """Bytes through `host`'s switch port (both directions)."""
    port = f"p{bed.names.index(host) + 1}"
    done = subprocess.run(["ip", "-n", bed.switch, "-s", "-j", "link", "show", port],
                          capture_output=True, text=True, check=True)
    stats = json.loads(done.stdout)[0]["stats64"]
    return stats["rx"]["bytes"] + stats["tx"]["bytes"]


def test_two_hosts_two_ranks_each(bed, tmp_path: Path) -> None:
    """--n-per-node 2 on a hostfile without slots; -x reaches remote ranks; only the
    master's output is shown; the ranks on host2 are reached over the veth link."""
    hostfile = bed.hostfile("hosts2", [None, None])
    before = _switch_bytes(bed, "host2")
    result = _report_job(bed, tmp_path, hostfile, ["--n-per-node", "2"],
                         "-x", "TNT_MH_EXPORT=from-x", "-x", "TNT_MH_SPACES=a b=c")
    through_link = _switch_bytes(bed, "host2") - before
    assert _placement(result) == [(0, 4, 0, 2, "host1"), (1, 4, 1, 2, "host1"),
                                  (2, 4, 0, 2, "host2"), (3, 4, 1, 2, "host2")]
    for r in result["ranks"]:
        assert r["env"]["TNT_MH_EXPORT"] == "from-x" and r["env"]["TNT_MH_SPACES"] == "a b=c"
        assert r["env"]["OMPI_MCA_btl"] == "tcp,self"  # no shared memory, even on one host
        assert r["reduced_ok"], r
    assert [line for line in result["stdout"].splitlines() if "stdout of rank" in line] == [
        "stdout of rank 0 on host1"]
    bw = result["busbw"]
    assert through_link > 9 * bw["bytes"], "the allreduces did not cross the veth link"
    record("2 hosts x 2 ranks, fused allreduce over the veth link", None, None,
           f": {bw['bytes'] / 2**20:.0f} MiB per round in {bw['seconds'] * 1e3:.1f} ms "
           f"(median of 7) = busbw {bw['busbw_gbs']:.2f} GB/s")


def test_three_hosts_one_rank_each_and_slots(bed, tmp_path: Path) -> None:
    """slots=1 on three hosts with -n 3; then slots=2,1 fills host1 first."""
    result = _report_job(bed, tmp_path / "a", bed.hostfile("hosts3", [1, 1, 1]), ["-n", "3"])
    assert _placement(result) == [(0, 3, 0, 1, "host1"), (1, 3, 0, 1, "host2"),
                                  (2, 3, 0, 1, "host3")]
    assert all(r["reduced_ok"] for r in result["ranks"])
    result = _report_job(bed, tmp_path / "b", bed.hostfile("slots21", [2, 1]), ["-n", "3"])
    assert _placement(result) == [(0, 3, 0, 2, "host1"), (1, 3, 1, 2, "host1"),
                                  (2, 3, 0, 1, "host2")]


@pytest.mark.parametrize(("hosts", "layout"), [(2, ["--n-per-node", "2"]), (3, ["-n", "3"])],
                         ids=["2x2", "3x1"])
def test_exactness_across_hosts(bed, tmp_path: Path, hosts: int, layout: list[str]) -> None:
    """tnt.Model on ranks of several hosts equals serial Keras (dense and CNN, B % N != 0)."""
    hostfile = bed.hostfile(f"exact{hosts}", [None] * hosts)
    out = tmp_path / "exactness.json"
    job = start_job(bed, tmp_path, [
        "--hostfile", str(hostfile), *layout, *PY, "-x", "OMP_NUM_THREADS=1",
        "-x", "TF_DETERMINISTIC_OPS=1", "--", str(JOBS / "exactness.py"), "--out", str(out)])
    assert job.wait(600) == 0, job.output()
    result = json.loads(out.read_text())
    size = 4 if hosts == 2 else 3
    assert result["ranks"] == size
    assert sorted(set(result["hosts"])) == bed.names[:hosts]
    for name, case in result["cases"].items():
        assert case["batch"] % size != 0, name
        assert case["history_diff"] <= case["tol_loss"], (name, case)
        assert case["evaluate_diff"] <= case["tol_loss"], (name, case)
        assert case["weight_diff"] <= case["tol_weights"], (name, case)
        assert case["predict_diff"] <= case["tol_weights"], (name, case)
        assert case["ranks_identical"], name
    record(f"exactness {hosts} hosts ({size} ranks)", None, None,
           f": job took {time.time() - job.started:.0f} s; max diffs to serial: " + ", ".join(
               f"{n} hist {c['history_diff']:.1e} w {c['weight_diff']:.1e}"
               for n, c in result["cases"].items()))


def _steps_job(bed, tmp_path: Path, scenario: str, timeout: str = "300"):
    hostfile = bed.hostfile("fail", [None, None])
    return start_job(bed, tmp_path, ["--hostfile", str(hostfile), "--n-per-node", "2", *PY,
                                     "--", STEPS, "--out", str(tmp_path), "--scenario", scenario],
                     TNT_COMM_TIMEOUT=timeout)


def test_rank_raising_on_host2_ends_the_job(bed, tmp_path: Path) -> None:
    job = _steps_job(bed, tmp_path, "raise")
    failed_at = job.wait_for("failed_at")
    code = job.wait(60)
    seconds = time.time() - failed_at
    record("rank 3 raises on host2", seconds, code)
    assert code != 0 and seconds <= 10, job.output()
    err = job.stderr
    assert err.count("RuntimeError: deliberate failure on rank 3 (host2)") == 1, job.output()
    assert "\0" not in err and "MPI_ABORT" not in err, job.output()


def test_sigkill_of_every_process_on_host2(bed, tmp_path: Path) -> None:
    job = _steps_job(bed, tmp_path, "train")
    job.wait_for("training")
    killed_at = time.time()
    assert bed.kill_host("host2"), "no process ran on host2"
    code = job.wait(90)
    seconds = time.time() - killed_at
    record("SIGKILL of every process on host2", seconds, code)
    assert code != 0 and seconds <= 30, job.output()
    assert "tarantella: error: the job failed" in job.stderr, job.output()


def test_link_down_then_cleanup_on_every_host(bed, tmp_path: Path) -> None:
    """host2's link goes down mid-step: the stall error names the missing ranks within
    TNT_COMM_TIMEOUT + 10 s. Then `--cleanup --hostfile` stops what is left on every
    host (also marked leftovers of a crashed job), sparing a `tail -f` of the script."""
    timeout = 5
    job = _steps_job(bed, tmp_path, "train", timeout=str(timeout))
    job.wait_for("training")
    down_at = time.time()
    bed.link("host2", "down")
    try:
        code = job.wait(120)
        seconds = time.time() - down_at
    finally:
        bed.link("host2", "up")
    record(f"host2 link down (TNT_COMM_TIMEOUT={timeout})", seconds, code)
    assert code != 0 and seconds <= timeout + 10, job.output()
    named = re.findall(r"(?:Missing ranks \(never arrived\)|Ranks not answering \(dead or "
                       r"stuck\)): ([\d, ]+)", job.stderr)
    assert named and {2, 3} <= {int(r) for r in ",".join(named).split(",") if r.strip()}, job.output()
    assert "did not complete within 5 s" in job.stderr and "TNT_COMM_TIMEOUT" in job.stderr

    env = job_env(bed, TARANTELLA_JOB_ID="crashed-job")
    leftovers = {h: subprocess.Popen(bed.on(h, [sys.executable, STEPS, "--out", str(tmp_path),
                                                "--scenario", "sleep"]), env=env)
                 for h in bed.names}
    tail = subprocess.Popen(bed.on("host2", ["tail", "-f", STEPS]), stdout=subprocess.DEVNULL)
    try:
        time.sleep(1)  # let them start (they are only targets; nothing waits on them)
        hostfile = bed.hostfile("all", [None] * len(bed.names))
        started = time.time()
        done = subprocess.run(bed.on("host1", [TARANTELLA, "--cleanup", "--hostfile",
                                               str(hostfile), "--", STEPS]),
                              env=job_env(bed), capture_output=True, text=True, timeout=60)
        record("tarantella --cleanup --hostfile (3 hosts)", time.time() - started,
               done.returncode)
        assert done.returncode == 0, done.stdout + done.stderr
        for host, proc in leftovers.items():  # (the hosts share /proc: any host may stop it)
            assert proc.wait(timeout=10) != 0, f"leftover on {host} survived"
            assert f"stopping {proc.pid}: " in done.stdout, done.stdout
            assert f"[{bed.names.index(host)}] {host}: " in done.stdout  # ran on every host
        assert tail.poll() is None, "cleanup stopped a tail -f of the script"
        assert all(pids == [] or pids == [tail.pid] for pids in bed.processes().values())
    finally:
        tail.kill()
        tail.wait()
        for proc in leftovers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_testbed_names_are_unique_and_stale_beds_removed() -> None:
    """A bed whose creator died is removed by the next run; a live one is kept."""
    dead = testbed.TestBed(1, run="999999999-dead")
    dead.up()
    try:
        assert dead.switch in testbed.list_namespaces()
        removed = testbed.remove_stale()
        assert set(dead.namespaces) <= set(removed)
        assert not set(dead.namespaces) & set(testbed.list_namespaces())
    finally:
        dead.down()

