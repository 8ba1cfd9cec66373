"""The environment every rank receives: launcher settings, `-x` pairs, pass-through.

tnt-keras reads the `TNT_*` settings; they are documented in docs/launcher.md.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tnt_cli.errors import UsageError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: Prefixes of the caller's variables that every rank receives unchanged: Tarantella's
#: own, and the families of variables TensorFlow reads (logging, XLA, GPU, cuDNN, oneDNN).
#: Not every `TF_*`: other tools use that prefix too (Terraform's TF_CLI_CONFIG_FILE).
PASS_THROUGH_PREFIXES = ("TNT_", "TF_CPP_", "TF_XLA_", "TF_GPU_", "TF_CUDNN_", "TF_ONEDNN_")

#: Single TensorFlow variables outside those families (TF_CONFIG is left out on purpose:
#: it configures tf.distribute's own multi-worker set-up, which would fight the launcher).
TENSORFLOW_NAMES = frozenset({
    "TF_DETERMINISTIC_OPS", "TF_ENABLE_ONEDNN_OPTS", "TF_FORCE_GPU_ALLOW_GROWTH",
    "TF_FORCE_UNIFIED_MEMORY", "TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS",
    "TF_USE_LEGACY_KERAS", "TF_ENABLE_AUTO_MIXED_PRECISION", "TF_DISABLE_MKL",
    "TF_ENABLE_GPU_GARBAGE_COLLECTION", "TF_CPU_ALLOCATOR_USE_BFC", "TF_SYNC_ON_FINISH",
    "TF_DUMP_GRAPH_PREFIX", "TF_AUTOTUNE_THRESHOLD",
})

#: Every rank of one launch carries the same `TARANTELLA_JOB_ID` (and so does anything it
#: starts): `--cleanup` stops only processes marked with it. Not a `TNT_*` name: those
#: are settings, and tnt-keras warns about `TNT_*` variables it does not read. A
#: caller's own value (an outer job's) is replaced: each launch gets its own.
JOB_ID = "TARANTELLA_JOB_ID"

#: The launcher's own settings: read by the launcher, not sent to the ranks.
LAUNCHER_ONLY = frozenset({"TNT_MPIRUN"})


def new_job_id() -> str:
    """A job id unique on this machine and readable in `ps e`: host-pid-random."""
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


def passes_through(name: str) -> bool:
    """True for a caller's variable that every rank receives unchanged."""
    if name in LAUNCHER_ONLY:
        return False
    return name.startswith(PASS_THROUGH_PREFIXES) or name in TENSORFLOW_NAMES


def parse_export(item: str) -> tuple[str, str]:
    """Split one `-x NAME=VALUE` item at the first `=`; the value may hold `=` and spaces."""
    name, sep, value = item.partition("=")
    if not sep:
        raise UsageError(
            f"-x {item}: a value is required; write -x {item}=VALUE "
            f"(or -x {item}= for an empty value)"
        )
    if not _NAME.match(name):
        raise UsageError(
            f"-x {item}: {name!r} is not a valid environment variable name "
            "(letters, digits and _, not starting with a digit)"
        )
    return name, value


def parse_exports(items: Iterable[str]) -> dict[str, str]:
    """All `-x` items in the given order; a later item for the same name wins."""
    exports: dict[str, str] = {}
    for item in items:
        name, value = parse_export(item)
        exports.pop(name, None)  # keep the position of the last assignment
        exports[name] = value
    return exports


@dataclass(frozen=True)
class Settings:
    """Launcher options that reach the program as `TNT_*` variables."""

    log_level: str | None = None
    log_on_all_devices: bool = False
    output_on_all_devices: bool = False
    fusion_threshold_kb: int | None = None
    no_gpu: bool = False

    def as_env(self) -> dict[str, str]:
        """Only what the user asked for: unset options leave the program's defaults."""
        env: dict[str, str] = {}
        if self.fusion_threshold_kb is not None:
            env["TNT_FUSION_THRESHOLD"] = str(self.fusion_threshold_kb)
        if self.log_level is not None:
            env["TNT_LOG_LEVEL"] = self.log_level
        if self.log_on_all_devices:
            env["TNT_LOG_ON_ALL_DEVICES"] = "1"
        if self.output_on_all_devices:
            env["TNT_OUTPUT_ON_ALL_DEVICES"] = "1"
        if self.no_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env


def pass_through(caller_env: Mapping[str, str]) -> dict[str, str]:
    """The caller's `TNT_*` and TensorFlow variables, in the caller's order."""
    return {k: v for k, v in caller_env.items() if passes_through(k)}


def rank_environment(
    settings: Settings, exports: Mapping[str, str], caller_env: Mapping[str, str],
    job_id: str | None = None,
) -> dict[str, str]:
    """Variables to set on every rank, in order: pass-through, settings, `-x`, job id.

    An `-x` naming a variable that a launcher option sets is a conflict (which one
    should win is not obvious), so it is refused.
    """
    from_options = settings.as_env()
    clash = [name for name in exports if name in from_options]
    if clash:
        raise UsageError(
            f"-x {clash[0]}=... conflicts with the launcher option that sets {clash[0]}; "
            "give only one of them"
        )
    if JOB_ID in exports:
        raise UsageError(f"-x {JOB_ID}=...: the launcher sets {JOB_ID} itself (one per launch)")
    env = pass_through(caller_env)
    for source in (from_options, exports, {JOB_ID: job_id} if job_id else {}):
        for name, value in source.items():
            env.pop(name, None)
            env[name] = value
    return env
