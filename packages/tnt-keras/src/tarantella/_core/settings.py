"""Every ``TNT_*`` setting tnt-keras reads, parsed in one place.

The launcher (``tarantella --fusion-threshold ...``) passes these as environment
variables; a script started with plain ``python`` may set them too. A value that cannot
be parsed is an error naming the variable and the accepted values, never a silent default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: Default fusion threshold in KiB: buckets of up to 8 MiB (see docs/keras.md).
DEFAULT_FUSION_THRESHOLD_KB = 8192


class SettingError(ValueError):
    """A ``TNT_*`` environment variable holds a value that cannot be used."""


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingError(
        f"{name}={raw!r} is not a boolean; use one of true/false, 1/0, yes/no, on/off."
    )


def _fusion_threshold_bytes() -> int:
    name = "TNT_FUSION_THRESHOLD"
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return DEFAULT_FUSION_THRESHOLD_KB * 1024
    try:
        kib = float(raw)
    except ValueError:
        raise SettingError(
            f"{name}={raw!r} is not a number; give the fusion threshold in KB, "
            f"e.g. {name}=8192 (0 = one allreduce per tensor)."
        ) from None
    if kib != kib or kib == float("inf"):
        raise SettingError(
            f"{name}={raw!r} is not a finite number; give a threshold in KB >= 0 (0 = no fusion)."
        )
    if kib < 0:
        raise SettingError(
            f"{name}={raw!r} is negative; give a threshold in KB >= 0 (0 = no fusion)."
        )
    return int(kib * 1024)


def native_ops_enabled() -> bool:
    """``TNT_NATIVE_OPS`` (default on): build and use the native TensorFlow collectives."""
    return _flag("TNT_NATIVE_OPS", True)


def sparse_as_dense() -> bool:
    """``TNT_SPARSE_AS_DENSE`` (default off): densify sparse gradients (Embedding lookups)
    before the exchange — one allreduce instead of an allgather, but for Adam-like
    optimizers no longer serial Keras' update (docs/keras.md, "Sparse gradients")."""
    return _flag("TNT_SPARSE_AS_DENSE", False)


def transient_buckets() -> bool:
    """``TNT_COMM_TRANSIENT_BUCKETS`` (tnt_comm's, default on): the fused engine frees each
    bucket with its last holder instead of keeping a full gradient set of buckets (read
    here for the memory estimate; tnt_comm reports a value it cannot use)."""
    raw = os.environ.get("TNT_COMM_TRANSIENT_BUCKETS", "").strip()
    try:
        return raw == "" or float(raw) != 0.0
    except ValueError:
        return True


def timeline_path() -> str | None:
    """``TNT_TIMELINE`` (default unset): the Chrome-trace JSON the job's timeline is written
    to at exit (tarantella.timeline, docs/timeline.md)."""
    return os.environ.get("TNT_TIMELINE") or None


def sharding_level(value=None) -> int:
    """The sharding level of data replicas (DATA, ALL's replica axis): ``value`` (``sharding=``), else
    ``TNT_SHARDING`` (default 0: replicas hold everything, docs/sharding.md)."""
    name, raw = ("sharding", value) if value is not None else ("TNT_SHARDING", os.environ.get("TNT_SHARDING", "0"))
    try:
        level = int(str(raw).strip()) if not isinstance(raw, bool) else None
    except ValueError:
        level = None
    if level not in (0, 1, 2, 3):
        raise SettingError(f"{name}={raw!r} is no sharding level; use 0 (none), 1 (optimizer state), "
                           "2 (+ gradients) or 3 (+ parameters, DATA only); see docs/sharding.md.")
    return level


def _log_level() -> str:
    name = "TNT_LOG_LEVEL"
    raw = os.environ.get(name, "WARNING")
    level = raw.strip().upper()
    if level not in _LOG_LEVELS:
        raise SettingError(f"{name}={raw!r} is not a log level; use one of {', '.join(_LOG_LEVELS)}.")
    return level


#: Every TNT_* variable of Tarantella's packages (tnt-comm and the launcher read theirs).
KNOWN = frozenset({
    "TNT_FUSION_THRESHOLD", "TNT_LOG_LEVEL", "TNT_LOG_ON_ALL_DEVICES",
    "TNT_OUTPUT_ON_ALL_DEVICES", "TNT_TENSORBOARD_ON_ALL_DEVICES",
    "TNT_COMM_TIMEOUT", "TNT_COMM_POLL_SPIN_US", "TNT_COMM_POLL_MAX_SLEEP_US", "TNT_COMM_MPI",
    "TNT_MPIRUN", "TNT_NATIVE_OPS", "TNT_NATIVE_OPS_CACHE", "TNT_COMM_HANDOFF_SPIN_US",
    "TNT_COMM_WAIT_SPIN_US", "TNT_COMM_DRIVE_SPIN_US", "TNT_COMM_TRANSIENT_BUCKETS", "TNT_SPARSE_AS_DENSE", "TNT_TIMELINE", "TNT_SHARDING",
    "TNT_MEMORY_REPORT", "TNT_MEMORY_BUDGET", "TNT_MALLOC_MMAP_THRESHOLD",
})


def unknown_names() -> list[str]:
    """``TNT_*`` variables nobody reads (likely typos), each with a suggestion."""
    import difflib

    out = []
    for name in sorted(n for n in os.environ if n.startswith("TNT_") and n not in KNOWN):
        close = difflib.get_close_matches(name, sorted(KNOWN), n=1)
        out.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return out


@dataclass(frozen=True)
class Settings:
    """The parsed ``TNT_*`` settings of this process."""

    fusion_threshold_bytes: int
    log_level: str
    log_on_all_devices: bool
    output_on_all_devices: bool
    tensorboard_on_all_devices: bool
    native_ops: bool
    sparse_as_dense: bool = False


def load() -> Settings:
    """Read and validate every ``TNT_*`` variable tnt-keras uses."""
    return Settings(
        fusion_threshold_bytes=_fusion_threshold_bytes(),
        log_level=_log_level(),
        log_on_all_devices=_flag("TNT_LOG_ON_ALL_DEVICES", False),
        output_on_all_devices=_flag("TNT_OUTPUT_ON_ALL_DEVICES", False),
        tensorboard_on_all_devices=_flag("TNT_TENSORBOARD_ON_ALL_DEVICES", False),
        native_ops=native_ops_enabled(),
        sparse_as_dense=sparse_as_dense(),
    )
