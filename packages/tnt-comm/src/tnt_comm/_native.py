"""The C interface for native code in other packages (e.g. tarantella's TensorFlow ops).

Such code includes ``tnt_comm_c_api.h`` from :func:`c_api_include_dir` and, at run time,
receives the function table's address from :func:`c_api_address`; it never links this
package's extension. Handles come from ``Communicator.native_handle()`` and
``FusedAllreduce.native_handle()``.
"""

from __future__ import annotations

import os

from . import _runtime

#: The table layout native code was written against (``TNT_COMM_C_API_VERSION``).
C_API_VERSION = 3


def c_api_include_dir() -> str:
    """The directory holding ``tnt_comm_c_api.h`` (pass it to the compiler with ``-I``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def c_api_address() -> int:
    """The address of this process's ``tnt_comm_c_api`` table (starts tnt_comm if needed)."""
    _runtime.ensure()
    return int(_runtime._core.c_api_address())
