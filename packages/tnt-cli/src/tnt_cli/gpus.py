"""Count the GPUs of this host, to start one rank per GPU when -n is not given."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def count_gpus(environ: Mapping[str, str] | None = None, nvidia_proc: Path = NVIDIA_PROC) -> int:
    """GPUs visible to programs: `CUDA_VISIBLE_DEVICES` when set, else the NVIDIA driver's list."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e for e in visible.split(",") if e.strip()]
        return 0 if entries[:1] == ["-1"] else len(entries)
    try:
        return sum(1 for _ in nvidia_proc.iterdir())
    except OSError:
        return 0
