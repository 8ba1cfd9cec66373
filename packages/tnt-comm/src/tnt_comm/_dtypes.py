"""dtype handling shared by the collectives and the fused engine."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._runtime import _core

#: Element types the reductions (allreduce, FusedAllreduce) accept: the core's one list.
REDUCIBLE: tuple[str, ...] = tuple(_core.reducible_dtypes())


def as_dtype(dtype: Any) -> np.dtype:
    """``np.dtype(dtype)``, also for "bfloat16" (registered by ml_dtypes when installed)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        if isinstance(dtype, str) and dtype == "bfloat16":
            try:
                import ml_dtypes
            except ImportError as err:
                raise TypeError(
                    "dtype 'bfloat16' needs the ml_dtypes package: pip install ml_dtypes"
                ) from err
            return np.dtype(ml_dtypes.bfloat16)
        raise


# dtype -> reducible? (``dtype.name`` runs Python code inside numpy, ~1-10 us: more than
# a small collective; a dict lookup by the dtype itself is ~0.1 us)
_reducible_cache: dict[np.dtype, bool] = {}


def check_reducible(dtype: np.dtype, where: str) -> None:
    ok = _reducible_cache.get(dtype)
    if ok is None:
        ok = _reducible_cache[dtype] = dtype.name in REDUCIBLE
    if not ok:
        raise TypeError(
            f"{where}: dtype {dtype.name} cannot be reduced; supported: {', '.join(REDUCIBLE)}. "
            "Convert it first, e.g. array.astype(np.float32)"
        )


# (dtype, reducible) -> True once an array of that dtype passed every dtype check below:
# the common case then costs a type test, a flag read and a dict lookup (~0.2 us, where
# the full checks cost ~0.6 us: a sixth of a small allreduce).
_passed: dict[tuple[np.dtype, bool], bool] = {}


def check_array(array: Any, where: str, *, reducible: bool) -> np.ndarray:
    """The array itself if it can be sent as is; else TypeError/ValueError naming the fix."""
    if type(array) is np.ndarray and array.flags.c_contiguous and (array.dtype, reducible) in _passed:
        return array
    if not isinstance(array, np.ndarray):
        raise TypeError(
            f"{where}: expected a numpy.ndarray, got {type(array).__name__}; "
            "convert it with np.asarray(...)"
        )
    if array.dtype.hasobject:
        raise TypeError(
            f"{where}: arrays of Python objects cannot be sent; "
            "use broadcast_object/allgather_object for picklable objects"
        )
    if reducible:
        check_reducible(array.dtype, where)
    if not array.dtype.isnative:
        raise ValueError(
            f"{where}: the array is not in native byte order ({array.dtype.str}); "
            "convert it with array.astype(array.dtype.newbyteorder('='))"
        )
    if not array.flags.c_contiguous:
        raise ValueError(
            f"{where}: the array is not C-contiguous (a slice, transpose or strided view); "
            "pass np.ascontiguousarray(array)"
        )
    _passed[(array.dtype, reducible)] = True
    return array
