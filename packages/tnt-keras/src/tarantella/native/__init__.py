"""Native TensorFlow ops for tnt_comm's collectives, built against the installed TensorFlow.

Why: a ``tf.numpy_function`` op costs ~100-170 us of host time per call (the GIL, array
conversion, a Python frame); layer parallelism runs one blocking collective per split
block and direction, and data parallelism one submit per bucket, so that cost adds up
to milliseconds per step. The kernels in ``tnt_tf_ops.cc`` call tnt_comm through its C
interface (``tnt_comm_c_api.h``): no Python, no GIL.

How: TensorFlow's C++ ABI differs between releases, so the library cannot ship
prebuilt. It is compiled on first use with the system C++ compiler (``$CXX``, else
``c++``) and TensorFlow's own flags, into a cache keyed by the sources, TensorFlow's
version and flags (``$TNT_NATIVE_OPS_CACHE``, else ``~/.cache/tarantella``), under a
file lock so ranks sharing a file system build it once (~20 s). If it cannot be built or
loaded, or ``TNT_NATIVE_OPS=0``, every op falls back to ``tf.numpy_function`` with the
same graph structure and the same collectives underneath, so ranks that differ in this
still match each other. ``python -m tarantella.native`` builds it and reports.

Public: :func:`ops` (None under the fallback), :func:`in_use`, :data:`why_not`,
:func:`library_path`, :func:`build`, :func:`disabled`.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import tensorflow as tf

import tnt_comm

from .._core.log import logger
from .._core.settings import native_ops_enabled

_SOURCE = Path(__file__).with_name("tnt_tf_ops.cc")
_lock = threading.Lock()
_loaded: ModuleType | None = None
_tried = False
_forced_off = 0
#: Why the native ops are not in use (None while they are, or before the first try).
why_not: str | None = None


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or "c++"
    return shutil.which(cxx)


def _flags() -> list[str]:
    return [*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]


def _cache_dir() -> Path:
    root = os.environ.get("TNT_NATIVE_OPS_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tarantella"


def library_path() -> Path:
    """Where the library for this TensorFlow, tnt_comm and source lives (built or not)."""
    header = Path(tnt_comm.c_api_include_dir()) / "tnt_comm_c_api.h"
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), header.read_bytes(), tf.__version__.encode(),
                 " ".join(_flags()).encode(), str(_compiler()).encode()):
        key.update(part)
        key.update(b"\0")
    return _cache_dir() / f"tnt_tf_ops-{tf.__version__}-{key.hexdigest()[:16]}.so"


def build(path: Path) -> None:
    """Compile the op library to ``path`` (atomically: a half-written file never shows)."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building it right now
        if path.exists():
            return
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        cmd = [cxx, "-O2", "-shared", "-fPIC", "-w", str(_SOURCE), "-o", tmp,
               "-I", tnt_comm.c_api_include_dir(), *_flags()]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                tail = "\n".join(done.stderr.strip().splitlines()[-15:])
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{tail}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _load(path: Path) -> ModuleType:
    module = tf.load_op_library(str(path))
    # The same dlopen handle (the same path): hand it tnt_comm's function table.
    status = ctypes.CDLL(str(path)).tnt_tf_ops_set_api(ctypes.c_void_p(tnt_comm.c_api_address()))
    if status != 0:
        raise RuntimeError(
            f"tnt_comm's C interface is version {status}, the op library expects "
            f"{tnt_comm.C_API_VERSION}: reinstall tnt-comm and tnt-keras together")
    return module


def in_use() -> bool:
    """True when collectives run as native ops (builds them on first call)."""
    return ops() is not None


@tf.autograph.experimental.do_not_convert  # called while tracing: plain Python, no autograph
def ops() -> ModuleType | None:
    """The loaded op module (``tnt_allreduce``, ``tnt_allgather``, ``tnt_fused_submit``,
    ``tnt_fused_wait``, ``tnt_fused_wait_bucket``), building it if needed; None where the
    fallback is in use."""
    global _loaded, _tried, why_not
    if _forced_off:
        return None
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        if not native_ops_enabled():
            why_not = "TNT_NATIVE_OPS=0"
        else:
            try:
                path = library_path()
                if not path.exists():
                    logger.info("building tarantella's native TensorFlow ops into %s", path)
                    build(path)
                _loaded = _load(path)
            except Exception as e:  # any failure means: fall back
                why_not = f"{type(e).__name__}: {e}"
                logger.warning(
                    "tarantella's native TensorFlow ops are unavailable, so collectives run "
                    "through tf.numpy_function (slower, same results): %s. Set "
                    "TNT_NATIVE_OPS=0 to skip the attempt.", why_not)
        _tried = True
        return _loaded


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Graphs traced inside use the ``tf.numpy_function`` fallback (benchmarks, tests)."""
    global _forced_off
    _forced_off += 1
    try:
        yield
    finally:
        _forced_off -= 1
