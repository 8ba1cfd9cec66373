"""The default per-rank memory budget of ``ParallelStrategy.AUTO`` / ``tnt.plan_parallel``.

On a GPU the device's memory; on CPU this rank's share of the host: ``RLIMIT_DATA`` when
set (a cap on this process, less what it already holds: TensorFlow and MPI take hundreds
of MiB before a model exists), else the cgroup's limit or the host's available memory,
divided by the ranks on this host.
"""

from __future__ import annotations

import os
import resource


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # cgroup v1 says "no limit" with a huge number
            return int(text)
    return None


def _proc_kib_field(path: str, field: str) -> int | None:
    """A ``Field:   N kB`` line of a /proc file, in bytes (None: unreadable or absent)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _available() -> int | None:
    return _proc_kib_field("/proc/meminfo", "MemAvailable")


def _vm_data() -> int:
    """This process' private data in use (what ``RLIMIT_DATA`` limits), bytes."""
    return _proc_kib_field("/proc/self/status", "VmData") or 0


def _gpu_bytes() -> int | None:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    details = tf.config.experimental.get_device_details(gpus[0])
    total = details.get("memory_limit") or details.get("device_memory_size")
    return int(total) if total else None


def ranks_on_host(num_ranks: int) -> int:
    """Ranks sharing this host: the launcher's local size when told, else all of them."""
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return max(1, num_ranks)


def default_budget(num_ranks: int) -> tuple[int | None, str]:
    """(bytes per rank, where the figure comes from); None when nothing could be read."""
    gpu = _gpu_bytes()
    if gpu:
        return gpu, "the GPU's memory"
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    if soft not in (resource.RLIM_INFINITY, -1) and soft > 0:
        used = _vm_data()  # the cap counts what the process already holds (TensorFlow, MPI)
        return max(int(soft) - used, 0), f"RLIMIT_DATA of this process minus its VmData now ({used // 2**20} MiB)"
    cgroup = _cgroup_limit()
    if cgroup:
        n = ranks_on_host(num_ranks)
        return cgroup // n, f"the cgroup's memory limit / {n} rank(s) on this host"
    available = _available()
    if available:
        n = ranks_on_host(num_ranks)
        return available // n, f"available host memory / {n} rank(s) on this host"
    return None, "unknown"
