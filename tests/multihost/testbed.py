"""A multi-host test bed on one machine: each "host" is a Linux network namespace.

    python tests/multihost/testbed.py up 3      # build host1..host3, print how to use them
    python tests/multihost/testbed.py down      # remove every test bed of this machine

Topology (all of it inside namespaces this module creates; nothing is added to the
machine's own network namespace, and no address outside 10.213.0.0/24 is ever used):

    tntmh-<run>-sw:     bridge br0, ports p1..pK
    tntmh-<run>-hostI:  lo, eth0 = 10.213.0.I/24 (veth peer of pI), hostname hostI

Unlike real hosts, the hosts share one PID namespace and file system: /proc shows every
host's processes (so a `--cleanup` on one host also sees the others'), and the job's
files are on a "shared file system" as on most clusters.

A host's namespaces (network, UTS with its name, mount with its /etc/hosts) are held
by a keeper process; `on(host, argv)` enters them with `nsenter`. Open MPI starts remote daemons through its rsh agent; the agent written here
maps a host name to its keeper and runs the command there, with a login-like
environment (like ssh: nothing of
the caller's environment leaks to the remote host, so `-x` must carry it). The
`OMPI_MCA_*`/`PRTE_MCA_*` settings from `mca_env()` make ranks talk TCP on the veth
subnet only (no shared memory, which would silently bypass the network).

Names carry the creating process's pid, so concurrent runs never collide, and
`remove_stale()` deletes test beds whose creator is gone (a crashed run).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "tntmh-"
SUBNET = "10.213.0"  # /24, only ever assigned inside our namespaces
NETNS_DIR = Path("/run/netns")
#: `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*: per-host /etc/hosts.
ETC_NETNS = Path("/etc/netns")
#: What a remote login gets (ssh does not forward the caller's environment).
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class TestBedUnavailable(RuntimeError):
    """Namespaces cannot be created here (not root, no CAP_NET_ADMIN, no iproute2)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _owner_alive(name: str) -> bool:
    """A test bed name is tntmh-<pid>-...; its creator is alive if that pid is.

    Beds made by hand (`testbed.py up`) are tntmh-keep-...: kept until `down`.
    """
    pid = name[len(PREFIX):].split("-", 1)[0]
    return not pid.isdigit() or Path(f"/proc/{pid}").exists()


def list_namespaces() -> list[str]:
    done = _ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def pids_in(namespace: str) -> list[int]:
    """Processes whose network namespace is `namespace` (`ip netns pids`)."""
    done = _ip("netns", "pids", namespace, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _kill_and_delete(namespace: str) -> None:
    for _ in range(50):
        pids = pids_in(namespace)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    _ip("netns", "delete", namespace, check=False)
    shutil.rmtree(ETC_NETNS / namespace, ignore_errors=True)
    try:
        ETC_NETNS.rmdir()  # only if empty: it may have been made for us
    except OSError:
        pass


def remove_stale(all_of_them: bool = False) -> list[str]:
    """Delete test beds whose creating process is gone (or every one with all_of_them)."""
    removed = []
    for name in list_namespaces():
        if name.startswith(PREFIX) and (all_of_them or not _owner_alive(name)):
            _kill_and_delete(name)
            removed.append(name)
    for folder in (ETC_NETNS, Path(tempfile.gettempdir())):
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            if entry.name.startswith(PREFIX) and (all_of_them or not _owner_alive(entry.name)):
                shutil.rmtree(entry, ignore_errors=True)
    return removed


def check_available() -> None:
    """Raise TestBedUnavailable naming the reason when namespaces cannot be made."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        raise TestBedUnavailable("needs iproute2 ('ip') and util-linux ('unshare')")
    if os.geteuid() != 0:
        raise TestBedUnavailable("needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create "
                                 "network namespaces; run `nox -s multihost` as root")
    probe = f"{PREFIX}{os.getpid()}-probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        raise TestBedUnavailable(f"'ip netns add' failed: {done.stderr.strip()}")
    _ip("netns", "delete", probe, check=False)


def must_fail(ci: str | None, euid: int) -> bool:
    """Whether an unavailable test bed fails the multi-host tests instead of skipping them.

    ``ci``: the CI environment variable (CI services set it to "true"); ``euid``: the
    effective user id. A CI job running as root is meant to run these tests: there a bed
    that cannot be made is an error, not a reason to skip. Anywhere else (a developer's
    machine, or CI without root) the tests skip and say why.
    """
    return (ci or "").strip().lower() in ("true", "1", "yes") and euid == 0


@dataclass
class TestBed:
    """K hosts (host1..hostK) on one bridge; `up()` builds them, `down()` removes all."""

    hosts: int
    run: str = field(default_factory=lambda: f"{os.getpid()}-{os.urandom(2).hex()}")
    workdir: Path = field(init=False)  # agent script and hostfiles (a new temporary folder)

    def __post_init__(self) -> None:
        self.names = [f"host{i}" for i in range(1, self.hosts + 1)]
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{self.run}-"))
        self.keepers: dict[str, subprocess.Popen[bytes]] = {}
        self.init_pids: dict[str, int] = {}

    # -- names -----------------------------------------------------------------
    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.run}-sw"

    def namespace(self, host: str) -> str:
        return f"{PREFIX}{self.run}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.names.index(host) + 1}"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch, *(self.namespace(h) for h in self.names)]

    @property
    def agent(self) -> Path:
        return self.workdir / "netns-agent"

    # -- life cycle ----------------------------------------------------------------
    def up(self) -> TestBed:
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(h)} {h}\n" for h in self.names)
        for i, host in enumerate(self.names, start=1):
            ns = self.namespace(host)
            _ip("netns", "add", ns)
            _ip("-n", self.switch, "link", "add", f"p{i}", "type", "veth",
                "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # IPv4 only: no link-local IPv6 addresses for Open MPI to wander onto.
            _ip("netns", "exec", ns, "sh", "-c",
                "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6")
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / ns / "hosts").write_text(hosts_file)
            self._start_keeper(host)
        self._write_agent()

    def _start_keeper(self, host: str) -> None:
        """A sleeping process holding the host's network, UTS and mount namespaces."""
        self.keepers[host] = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(host), "unshare", "--uts", "--fork",
             "sh", "-c", f'hostname {host} && exec sleep 100000'])
        children = Path(f"/proc/{self.keepers[host].pid}/task/{self.keepers[host].pid}/children")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pid = children.read_text().split() if children.exists() else []
            if pid and Path(f"/proc/{pid[0]}/cmdline").read_bytes().startswith(b"sleep"):
                self.init_pids[host] = int(pid[0])
                return
            time.sleep(0.02)
        raise RuntimeError(f"the namespaces of {host} did not come up")

    def down(self) -> None:
        for keeper in self.keepers.values():
            keeper.kill()
            keeper.wait()
        for ns in reversed(self.namespaces):
            if ns in list_namespaces() or (ETC_NETNS / ns).exists():
                _kill_and_delete(ns)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _write_agent(self) -> None:
        cases = "".join(f"  {h}) pid={self.init_pids[h]} ;;\n" for h in self.names)
        self.agent.write_text(
            "#!/bin/sh\n"
            "# Open MPI rsh agent of a tarantella test bed: 'ssh HOST CMD' runs CMD\n"
            "# in HOST's namespaces (nsenter), with a login environment.\n"
            'host="$1"; shift\n'
            'case "$host" in\n'
            f"{cases}"
            '  *) echo "netns-agent: unknown host $host" >&2; exit 255 ;;\n'
            "esac\n"
            'exec nsenter -t "$pid" --net --uts --mount -- '
            f"env -i HOME={shlex.quote(str(Path.home()))} PATH={LOGIN_PATH} LANG=C.UTF-8 "
            'sh -c "$*"\n'
        )
        self.agent.chmod(self.agent.stat().st_mode | stat.S_IXUSR)

    # -- running things on a host --------------------------------------------------
    def on(self, host: str, argv: list[str]) -> list[str]:
        """argv that runs `argv` on `host` (its namespaces), environment inherited."""
        return ["nsenter", "-t", str(self.init_pids[host]), "--net", "--uts", "--mount", "--",
                *argv]

    def mca_env(self) -> dict[str, str]:
        """Open MPI settings for jobs on the bed: our agent, TCP on the veth subnet only."""
        subnet = f"{SUBNET}.0/24"
        return {
            "PRTE_MCA_plm_ssh_agent": str(self.agent),
            # session directories (also those of killed daemons) go with the bed
            "PRTE_MCA_prte_tmpdir_base": str(self.workdir),
            "PRTE_MCA_oob_tcp_if_include": subnet,
            "OMPI_MCA_oob_tcp_if_include": subnet,
            "OMPI_MCA_btl": "tcp,self",
            "OMPI_MCA_btl_tcp_if_include": subnet,
            "OMPI_MCA_pml": "ob1",
        }

    def hostfile(self, name: str, slots: list[int | None]) -> Path:
        """A hostfile naming the first len(slots) hosts, `slots=K` where given."""
        lines = [h if s is None else f"{h} slots={s}" for h, s in zip(self.names, slots)]
        path = self.workdir / name
        path.write_text("\n".join(lines) + "\n")
        return path

    def _keeping(self, host: str) -> set[int]:
        keeper = self.keepers.get(host)
        return {self.init_pids.get(host, -1), keeper.pid if keeper else -1}

    def processes(self) -> dict[str, list[int]]:
        """Processes on each host (its keeper left out)."""
        return {h: [p for p in pids_in(self.namespace(h)) if p not in self._keeping(h)]
                for h in self.names}

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process on `host` (not its keeper: the host stays up)."""
        pids = self.processes()[host]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def link(self, host: str, state: str) -> None:
        """Take `host`'s network link 'down' or 'up' (its switch port)."""
        _ip("-n", self.switch, "link", "set", f"p{self.names.index(host) + 1}", state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a test bed and keep it until 'down'")
    up.add_argument("hosts", type=int, nargs="?", default=2)
    sub.add_parser("down", help="remove every tarantella test bed of this machine")
    args = parser.parse_args(argv)
    if args.command == "down":
        for name in remove_stale(all_of_them=True):
            print(f"removed {name}")
        return 0
    check_available()
    bed = TestBed(args.hosts, run=f"keep-{os.urandom(2).hex()}").up()
    hostfile = bed.hostfile("hosts", [None] * args.hosts)
    env = " ".join(f"{k}={v}" for k, v in bed.mca_env().items())
    print(f"hosts {', '.join(bed.names)} are up; hostfile {hostfile}\n"
          f"run a job on host1:\n  {env} \\\n  {shlex.join(bed.on('host1', ['tarantella']))} "
          f"--hostfile {hostfile} -n {args.hosts} -- train.py\n"
          f"remove it with: {sys.executable} {__file__} down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
