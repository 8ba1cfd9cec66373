"""One array per request: how the master of a streamed save fetches a variable it does not
hold (``streamed_files``) from the rank that holds it, without either side copying more
than that one array.

The master sends a request (a small pickled object); the holder answers with a header
(dtype and shape, or None: it has no such variable) and the array's bytes, sent from the
variable's own memory. Every holder answers its requests in order until the master sends
None. Messages are numbered per holder (``tag``) and carry a ``step`` no training step
uses, so a mismatch shows in the header check instead of mixing with other traffic.
Layouts that stream their file share it: pipeline stages ask the stage holding a layer,
tensor shards ask every rank of the group for its slice of a split variable.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

#: Header "step" of a streamed save's messages (never a training step number).
STREAM_STEP = 2**30 + 1


class Peers(Protocol):
    """Point-to-point messages with ranks named as the layout names them (a pipeline's
    stages, a tensor group's ranks)."""

    def isend(self, array: np.ndarray, peer: int, header: tuple[int, int, int]) -> Any: ...

    def recv(self, peer: int, header: tuple[int, int, int], dtype, shape) -> np.ndarray: ...


class CommPeers:
    """A ``tnt_comm.Communicator`` as ``Peers``: arrays are sent from their own memory
    (answers are views of variables nobody changes while the save runs)."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def isend(self, array: np.ndarray, peer: int, header: Sequence[int]):
        return self.comm.isend(np.ascontiguousarray(array), peer, tuple(header), copy=False)

    def recv(self, peer: int, header: Sequence[int], dtype, shape) -> np.ndarray:
        return self.comm.recv(peer, tuple(header), dtype, tuple(shape))


def send_object(peers: Peers, obj, peer: int, tag: int, step: int = STREAM_STEP) -> list:
    """Start sending ``obj`` (pickled) to ``peer``; the requests to wait for."""
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    length = np.array([data.size], dtype=np.int64)
    return [peers.isend(length, peer, (step, 0, tag)), peers.isend(data, peer, (step, 1, tag))]


def recv_object(peers: Peers, peer: int, tag: int, step: int = STREAM_STEP):
    """The object ``peer`` sent with ``send_object`` under ``tag``."""
    length = int(peers.recv(peer, (step, 0, tag), np.int64, (1,))[0])
    data = peers.recv(peer, (step, 1, tag), np.uint8, (length,))
    return pickle.loads(data.tobytes())


def _wait(requests: Iterable) -> None:
    for request in requests:
        request.wait()


def serve(peers: Peers, master: int, answer: Callable[[Any], np.ndarray | None], first_tag: int = 1) -> None:
    """On a holder: answer the master's requests (``answer(request)``: the array, or None)
    one at a time until it sends None; each array is freed before the next request is read."""
    tag = first_tag
    while (asked := recv_object(peers, master, tag)) is not None:
        value = answer(asked)
        header = None if value is None else (value.dtype, value.shape)
        sends = send_object(peers, header, master, tag)
        if value is not None:
            sends.append(peers.isend(np.ascontiguousarray(value).reshape(-1).view(np.uint8), master,
                                     (STREAM_STEP, 2, tag)))
        _wait(sends)
        del value, sends
        tag += 1


class Asker:
    """On the master: requests to holders, one array per answer (``serve`` on each holder)."""

    def __init__(self, peers: Peers, holders: Iterable[int], first_tag: int = 1) -> None:
        self.peers = peers
        self._tags = dict.fromkeys(holders, first_tag)  # the next request's, by holder

    def ask(self, holder: int, request) -> np.ndarray | None:
        """``holder``'s answer to ``request``: a new array, or None (it has none)."""
        tag = self._tags[holder]
        self._tags[holder] += 1
        _wait(send_object(self.peers, request, holder, tag))
        header = recv_object(self.peers, holder, tag)
        if header is None:
            return None
        dtype, shape = header
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = self.peers.recv(holder, (STREAM_STEP, 2, tag), np.uint8, (nbytes,))
        return raw.view(dtype).reshape(shape)

    def stop(self) -> None:
        """Tell every holder that there is nothing more to ask (call it whatever happened)."""
        for holder, tag in self._tags.items():
            _wait(send_object(self.peers, None, holder, tag))


__all__ = ["STREAM_STEP", "Asker", "CommPeers", "Peers", "recv_object", "send_object", "serve"]
