"""Receives posted ahead (pipelining._receive_ahead): order, window, zero-copy tensors.

The launched pipelining jobs check that the values arriving this way train exactly as
serial Keras; these pin down the parts a job cannot see: how many receives are posted
when, and when a received buffer becomes a tensor without a copy.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tarantella.pipelining._receive_ahead import Receive, ReceiveAhead, as_tensor


def aligned(values: np.ndarray, offset_bytes: int = 0) -> np.ndarray:
    """A copy of ``values`` starting ``offset_bytes`` past a 64-byte boundary."""
    raw = np.empty(values.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset_bytes
    out = raw[start:start + values.nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    return out


def test_an_aligned_buffer_becomes_a_tensor_without_a_copy():
    a = aligned(np.arange(12, dtype=np.float32).reshape(3, 4))
    t = as_tensor(a)
    np.testing.assert_array_equal(t.numpy(), np.arange(12).reshape(3, 4))
    a[0, 0] = 99.0  # the tensor is a view of the received buffer
    assert float(t[0, 0]) == 99.0


@pytest.mark.parametrize("make", [
    lambda v: aligned(v, offset_bytes=4),  # not on TensorFlow's 64-byte boundary
    lambda v: aligned(v)[:, ::2],  # not contiguous
    lambda v: np.frombuffer(aligned(v).tobytes(), v.dtype).reshape(v.shape),  # read-only
], ids=["unaligned", "strided", "read_only"])
def test_other_buffers_are_copied(make):
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = make(values)
    t = as_tensor(a)
    np.testing.assert_array_equal(t.numpy(), np.asarray(a))
    if a.flags.writeable:
        a[0, 0] = 99.0
        assert float(t[0, 0]) == 0.0  # a copy: unaffected


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "int16", "int32", "int64",
                                   "uint8", "uint16", "uint32", "uint64", "bool", "complex64"])
def test_every_dtype_arrives_with_its_values(dtype):
    values = (np.arange(16) % 3).astype(dtype)
    t = as_tensor(aligned(values))
    assert t.dtype.name == np.dtype(dtype).name
    np.testing.assert_array_equal(t.numpy(), values)


def test_a_bool_buffer_is_copied():
    a = aligned(np.array([True, False, True, True]))
    np.testing.assert_array_equal(as_tensor(a).numpy(), [True, False, True, True])


class RecordingTransport:
    """Records every irecv; a receive's wait returns its header as an array."""

    def __init__(self) -> None:
        self.posted: list[tuple] = []
        self.taken = 0

    def irecv(self, stage, header, dtype, shape):
        self.posted.append((stage, header))
        transport = self

        class Pending:
            def wait(self_inner):
                transport.taken += 1
                return aligned(np.array(header, dtype=np.int64))
        return Pending()


@pytest.mark.parametrize("window", [1, 2])
def test_receives_are_posted_in_order_and_at_most_window_ahead(window):
    receives = [Receive(k % 2, (7, k, 0), np.int64, (3,)) for k in range(5)]
    t = RecordingTransport()
    inbox = ReceiveAhead(t, receives, window=window)
    assert len(t.posted) == window  # posted at once, before any is asked for
    for k in range(5):
        got = inbox.next()
        assert tuple(got.numpy()) == (7, k, 0)  # in action order
        assert len(t.posted) - t.taken == min(window, 5 - t.taken)  # the window refilled
    assert t.posted == [(r.stage, r.header) for r in receives]


def test_an_error_of_a_posted_receive_reaches_the_caller():
    class Failing:
        def irecv(self, stage, header, dtype, shape):
            class Pending:
                def wait(self_inner):
                    raise RuntimeError(f"mismatch at {header}")
            return Pending()

    inbox = ReceiveAhead(Failing(), [Receive(0, (1, 0, 0), np.float32, (2,))])
    with pytest.raises(RuntimeError, match=r"mismatch at \(1, 0, 0\)"):
        inbox.next()


def test_tensors_made_from_received_buffers_stay_valid_after_the_array_is_dropped():
    t = as_tensor(aligned(np.full((256, 256), 2.5, np.float32)))
    import gc

    gc.collect()
    assert float(tf.reduce_sum(t)) == 2.5 * 256 * 256
