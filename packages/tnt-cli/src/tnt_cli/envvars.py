"""The environment every rank receives: launcher settings, `-x` pairs, pass-through.

tnt-keras reads the `TNT_*` settings; they are documented in docs/launcher.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tnt_cli.errors import UsageError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: Prefixes of the caller's variables that every rank receives unchanged.
PASS_THROUGH_PREFIXES = ("TNT_", "TF_")

#: The launcher's own settings: read by the launcher, not sent to the ranks.
LAUNCHER_ONLY = frozenset({"TNT_MPIRUN"})


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
    """The caller's `TNT_*` and `TF_*` variables, in the caller's order."""
    return {
        k: v
        for k, v in caller_env.items()
        if k.startswith(PASS_THROUGH_PREFIXES) and k not in LAUNCHER_ONLY
    }


def rank_environment(
    settings: Settings, exports: Mapping[str, str], caller_env: Mapping[str, str]
) -> dict[str, str]:
    """Variables to set on every rank, in order: pass-through, settings, then `-x`.

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
    env = pass_through(caller_env)
    for source in (from_options, exports):
        for name, value in source.items():
            env.pop(name, None)
            env[name] = value
    return env
