"""The ``tarantella`` logger: rank-prefixed, master rank only unless asked otherwise."""

from __future__ import annotations

import logging

logger = logging.getLogger("tarantella")


class _MasterOnly(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self._rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self._rank == 0


def configure(rank: int, level: str, on_all_devices: bool) -> None:
    """Attach one handler that prefixes records with the rank (idempotent)."""
    if getattr(logger, "_tnt_configured", False):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[tarantella rank {rank}] %(levelname)s: %(message)s"))
    if not on_all_devices:
        handler.addFilter(_MasterOnly(rank))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    logger._tnt_configured = True  # type: ignore[attr-defined]
