"""A stage's receives, posted ahead of the actions that consume them.

A blocking receive on the critical path costs the transfer (a 4 MiB activation ~1.5 ms
here) plus a copy into a TensorFlow tensor (~1.7 ms): at 16 hops a step that was 4-6 % of
the step's span on the benchmark's balanced model. Posted one receive ahead, a message
moves while the stage computes the micro-batch before it (the communication thread
drives it), and TensorFlow takes the received buffer without a copy.

Receives are posted in action order, so the receives from any one peer are posted in
the order that peer sends: the order the blocking receives had. The receive posted
ahead holds one boundary tensor's buffer beyond what the blocking receive held.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from ._transport import Request, Transport

#: dtypes TensorFlow imports through DLPack (bool and strings are copied).
_DLPACK_DTYPES = frozenset(np.dtype(t) for t in (
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"))
#: TensorFlow requires a tensor's buffer to start on this boundary (it aborts otherwise).
_TF_ALIGN_BYTES = 64


class Receive(NamedTuple):
    """One expected message: from ``stage``, with ``header``, of ``dtype`` and ``shape``."""

    stage: int
    header: tuple[int, int, int]
    dtype: Any
    shape: tuple[int, ...]


class ReceiveAhead:
    """Hands out the step's messages in order, with up to ``window`` receives posted.

    The first ``window`` are posted at once; each time one is taken, the next is posted,
    so with ``window=1`` the next message moves while the stage computes with this one.
    """

    def __init__(self, transport: Transport, receives: list[Receive], window: int = 1) -> None:
        self._transport = transport
        self._receives = receives
        self._window = window
        self._posted: deque[Request] = deque()
        self._next_to_post = 0
        self._post(window)

    def next(self) -> tf.Tensor:
        """The next message in action order, as a tensor."""
        array = self._posted.popleft().wait()
        self._post(self._window - len(self._posted))
        return as_tensor(array)

    def _post(self, count: int) -> None:
        for _ in range(count):
            if self._next_to_post == len(self._receives):
                return
            r = self._receives[self._next_to_post]
            self._posted.append(self._transport.irecv(r.stage, r.header, r.dtype, r.shape))
            self._next_to_post += 1


def as_tensor(array: np.ndarray) -> tf.Tensor:
    """``array`` as a tensor, sharing its buffer when TensorFlow can take it.

    tnt_comm's receive buffers are 64-byte aligned, C-contiguous and owned by the array
    alone, so TensorFlow takes them through DLPack (2 us instead of a 1.7 ms copy for
    4 MiB); anything else is copied.
    """
    if (array.dtype in _DLPACK_DTYPES and array.size and array.flags.c_contiguous
            and array.flags.writeable and array.ctypes.data % _TF_ALIGN_BYTES == 0):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)
