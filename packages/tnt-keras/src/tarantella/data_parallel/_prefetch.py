"""Level 3's prefetch: the next layer's allgather runs while the current layer computes.

Why a thread of our own: a level-3 collective inside the step is a ``tf.numpy_function``,
which blocks the TensorFlow thread running it until the collective ends; with one
inter-op thread (tnt's benchmarks, a loaded host) nothing else of the step runs meanwhile.
So a gather is cut in two graph ops: *start* hands the collective to :class:`CommWorker`
(one daemon thread per replica, running its collectives one at a time in submission
order) and returns at once; *wait* blocks until that collective ended and returns its
result. Every level-3 collective of a step, the reduce-scatters included, goes through the
same worker, so each replica runs them in the order its graph submits them — the token
chain's order, the same on every replica (docs/sharding.md, "Level 3").

Which layer comes next is predicted (:func:`predict_next`): a prediction that proves wrong
costs the gather it started (waited for and dropped), never a value or the order.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import tensorflow as tf


class CommWorker:
    """One daemon thread running submitted collectives in submission order (FIFO)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[int, Future] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> int:
        """Queue ``fn(*args)``; the key :meth:`result` takes. ``args`` must stay unchanged
        until it ran (pass copies of a TensorFlow op's inputs)."""
        future: Future = Future()
        with self._lock:
            key = next(self._keys)
            self._futures[key] = future
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tnt-shard3-comm", daemon=True)
                self._thread.start()
        self._queue.put((future, fn, args))
        return key

    def result(self, key: int) -> Any:
        """Block (the GIL released) until the collective of ``key`` ended; its result or error."""
        with self._lock:
            future = self._futures.pop(key)
        return future.result()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` after every collective submitted before (blocking)."""
        return self.result(self.submit(fn, *args))

    def _run(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # handed to the waiting graph op
                future.set_exception(error)


@dataclass
class Pending:
    """A started gather nobody waited for yet: of ``layer``'s weights, for the forward call
    number ``call`` (or its backward), with the owned values it was started from."""

    layer: object
    call: int
    key: tf.Tensor
    read: tf.Tensor | None


def predict_next(order: Sequence[int], call: int, backward: bool) -> int | None:
    """The call number (an index into ``order``, the layer of each forward call in call
    order) whose weights are gathered next after call ``call``'s: the following call in the
    forward, the preceding one in backprop (which runs the calls in reverse); None at the end."""
    nxt = call - 1 if backward else call + 1
    return nxt if 0 <= nxt < len(order) else None
