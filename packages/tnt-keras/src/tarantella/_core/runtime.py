"""Process-level set-up: the communicator, the rank API and device placement.

Importing ``tarantella`` initialises tnt_comm (a plain ``python train.py`` is a valid
1-rank run) and, where GPUs exist, makes exactly one GPU visible to each process, chosen
by its rank on the host, with memory growth on. This must happen before TensorFlow
touches the GPUs, hence at import time.
"""

from __future__ import annotations

import tnt_comm

from . import log as _logging
from . import settings as _settings

MASTER_RANK = 0


def get_rank() -> int:
    """This process's rank in ``0 .. get_size() - 1``."""
    return tnt_comm.rank()


def get_size() -> int:
    """The number of processes training together."""
    return tnt_comm.size()


def get_master_rank() -> int:
    """The rank that writes files and prints progress (always 0)."""
    return MASTER_RANK


def is_master_rank() -> bool:
    """True on the rank that writes checkpoints, logs and progress bars."""
    return get_rank() == MASTER_RANK


def fusion_threshold_bytes() -> int:
    """The fused engine's bucket size limit (TNT_FUSION_THRESHOLD_BYTES or the default)."""
    return _settings.load().fusion_threshold_bytes


def _select_gpu(local_rank: int) -> None:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    gpu = gpus[local_rank % len(gpus)]
    try:
        tf.config.set_visible_devices(gpu, "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
    except RuntimeError as err:  # TensorFlow already initialised its devices
        _logging.logger.warning(
            "could not pin this rank to %s (%s); import tarantella before creating "
            "any TensorFlow tensor so that each rank gets its own GPU.",
            gpu.name,
            err,
        )


def setup() -> _settings.Settings:
    """Initialise communication, logging and devices once per process."""
    tnt_comm.init()
    settings = _settings.load()
    _logging.configure(get_rank(), settings.log_level, settings.log_on_all_devices)
    unknown = _settings.unknown_names()
    if unknown and not getattr(setup, "_warned", False):
        setup._warned = True  # type: ignore[attr-defined]
        _logging.logger.warning("unknown setting(s) ignored: %s", ", ".join(unknown))
    from . import internals as _internals

    version_warning = _internals.version_warning()
    if version_warning and not getattr(setup, "_warned_version", False):
        setup._warned_version = True  # type: ignore[attr-defined]
        _logging.logger.warning(version_warning)
    _select_gpu(tnt_comm.local_rank())
    return settings
