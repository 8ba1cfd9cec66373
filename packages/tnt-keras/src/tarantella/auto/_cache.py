"""A profile kept in a file, per model configuration, micro-batch sizes and machine, so a
second plan of the same model on the same machine measures nothing (``profile_file=``)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

from ._profile import LayerCost, Profile


def key(model, rows: list[int], sequence_length: int | None = None, ranks_on_host: int = 1) -> str:
    """What a stored profile must match: the model's config, the rows, the length of its
    open dimensions, this machine and the ranks sharing it."""
    try:
        config = json.dumps(model.get_config(), sort_keys=True, default=str)
    except (NotImplementedError, TypeError, ValueError):
        config = model.name + str([(v.path, tuple(v.shape)) for v in model.weights])
    machine = f"{platform.node()}|{platform.machine()}|{os.cpu_count()}|{os.environ.get('OMP_NUM_THREADS', '')}"
    length = "" if sequence_length is None else f"|length={sequence_length}"
    sharing = "" if ranks_on_host == 1 else f"|ranks_on_host={ranks_on_host}"
    return hashlib.sha256(f"{config}|{sorted(set(rows))}|{machine}{length}{sharing}".encode()).hexdigest()


def load(path: str | os.PathLike, wanted: str) -> Profile | None:
    """The stored profile when its key is ``wanted`` (None: absent, other, unreadable)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != wanted:
        return None
    p = data["profile"]
    return Profile(p["model_name"], [LayerCost(**c) for c in p["layers"]], tuple(p["rows_measured"]),
                   [*p["notes"], f"profile read from {path}"], p.get("update_s_per_variable", 0.0),
                   p.get("update_s_per_byte", 0.0), p.get("call_s", 0.0), p.get("step_s", 0.0),
                   p.get("pipeline_step_s", 0.0), p.get("pipeline_micro_batch_s", 0.0),
                   p.get("pipeline_variable_s", 0.0), p.get("sequence_length"), p.get("contention", 1.0),
                   p.get("ranks_on_host", 1))


def store(path: str | os.PathLike, wanted: str, prof: Profile) -> None:
    """Write ``prof`` under ``wanted`` (atomically: a reader never sees half a file)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"key": wanted, "profile": asdict(prof)}, indent=1))
    tmp.replace(target)
