"""NUMA pinning through numactl: which node a rank goes to, and clear errors."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tnt_cli.errors import EnvironmentProblem

NODE_DIR = Path("/sys/devices/system/node")
_NODE = re.compile(r"node(\d+)\Z")


def numa_nodes(node_dir: Path = NODE_DIR) -> list[int]:
    """NUMA node ids of this machine, from sysfs; error when the kernel exposes none."""
    try:
        ids = sorted(int(m.group(1)) for p in node_dir.iterdir() if (m := _NODE.match(p.name)))
    except OSError:
        ids = []
    if not ids:
        raise EnvironmentProblem(
            f"--pin-to-socket needs NUMA information, but {node_dir} lists no nodes "
            "(a container without /sys, or a kernel without NUMA); drop the option"
        )
    return ids


def find_numactl(path: str | None = None) -> str:
    found = shutil.which("numactl", path=path)
    if found is None:
        raise EnvironmentProblem(
            "--pin-to-socket/--pin-memory-to-socket need numactl, which is not on PATH; "
            "install it (e.g. 'apt-get install numactl' or 'dnf install numactl') "
            "or drop the option"
        )
    return found


def numactl_prefix(local_rank: int, mode: str, numactl: str, nodes: list[int]) -> list[str]:
    """`numactl --cpunodebind=N [--membind=N]` with N chosen round-robin by local rank."""
    node = nodes[local_rank % len(nodes)]
    argv = [numactl, f"--cpunodebind={node}"]
    if mode == "cpu+mem":
        argv.append(f"--membind={node}")
    return argv
