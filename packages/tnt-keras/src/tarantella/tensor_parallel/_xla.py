"""``jit_compile=True`` on a tensor-parallel model: XLA compiles the segments between the
tensor-group collectives.

The collectives are ops XLA cannot hold (they call the communication core), so the step
cannot be one XLA cluster as Keras' ``jit_compile=True`` would make it. TensorFlow's
auto-clustering does what is wanted instead: it compiles every maximal XLA-able segment
of the graph and leaves the collectives between them. It is a process-wide setting, so
tnt turns it on only while its own ``fit``/``evaluate``/``predict`` run (the functions
are instantiated there; a function's instantiation depends on the setting, so calls
outside get their own, uncompiled one) and restores the user's setting afterwards. On
CPU, TensorFlow clusters only with ``--tf_xla_cpu_global_jit`` in ``TF_XLA_FLAGS``,
which it reads once, when the first ``tf.function`` of the process runs: tarantella adds
it when imported (alone it changes nothing: auto-clustering stays off until asked for).
Import tarantella before running any function, else XLA leaves CPU graphs uncompiled
(results are the same either way).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import tensorflow as tf

_CPU_FLAG = "--tf_xla_cpu_global_jit"


def allow_cpu_clusters() -> None:
    """Let auto-clustering compile on CPU, where asked for (call before any function runs)."""
    flags = os.environ.get("TF_XLA_FLAGS", "")
    if _CPU_FLAG not in flags.split():
        os.environ["TF_XLA_FLAGS"] = f"{flags} {_CPU_FLAG}".strip()


@contextlib.contextmanager
def compiled_segments(enabled: bool) -> Iterator[None]:
    """Auto-clustering on for the functions instantiated inside (when ``enabled``)."""
    if not enabled:
        yield
        return
    allow_cpu_clusters()
    before = tf.config.optimizer.get_jit()
    tf.config.optimizer.set_jit("autoclustering")
    try:
        yield
    finally:
        tf.config.optimizer.set_jit(before or False)
