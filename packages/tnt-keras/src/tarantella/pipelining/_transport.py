"""How a stage talks to its pipeline and to the other replicas of its stage.

Peers are named by *stage* index; the transport maps stages to ranks through the mesh
(``tarantella._core.mesh``, docs/architecture.md, "The mesh"): the pipeline group of a
rank is its replica's p ranks, its replica group the ranks holding the same stage.

- :class:`CommTransport`: tnt_comm point-to-point messages (headers checked on receipt)
  and collectives on the two sub-communicators.
- :class:`LocalTransport`: the p stages of one replica as threads of one process, for
  tests and for trying a plan without launching (``run_local``); headers checked alike.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol

import numpy as np

from .._core.errors import PipelineError

#: Header field "boundary" of a message: activations 2b, gradients 2b + 1.
ACTIVATION, GRADIENT = 0, 1


def message_tag(boundary: int, kind: int) -> int:
    return 2 * boundary + kind


class Request(Protocol):
    def wait(self) -> Any: ...
    def test(self) -> bool: ...


class Transport(Protocol):
    stage: int
    num_stages: int
    replica: int
    num_replicas: int

    # The array must not change until the request completed (it may be sent without a copy).
    def isend(self, array: np.ndarray, stage: int, header: tuple[int, int, int]) -> Request: ...
    def recv(self, stage: int, header: tuple[int, int, int], dtype, shape) -> np.ndarray: ...
    def irecv(self, stage: int, header: tuple[int, int, int], dtype, shape) -> Request: ...
    def pipeline_allreduce(self, array: np.ndarray) -> np.ndarray: ...
    def pipeline_broadcast_object(self, obj: Any, root_stage: int) -> Any: ...
    def replica_allreduce(self, array: np.ndarray) -> np.ndarray: ...
    def replica_allgather(self, array: np.ndarray) -> np.ndarray: ...
    def replica_broadcast(self, array: np.ndarray) -> np.ndarray: ...


class _Done:
    def wait(self) -> None:
        return None

    def test(self) -> bool:
        return True


class _Deferred:
    """A local receive: taken from its channel when waited for (waits come in post order)."""

    def __init__(self, transport: LocalTransport, args: tuple) -> None:
        self._transport, self._args = transport, args

    def wait(self) -> np.ndarray:
        return self._transport.recv(*self._args)


class _LocalHub:
    """Shared state of the p threads of a LocalTransport pipeline."""

    def __init__(self, num_stages: int, timeout: float) -> None:
        self.num_stages = num_stages
        self.timeout = timeout
        self.channels = {(a, b): queue.Queue() for a in range(num_stages) for b in range(num_stages)}
        self.barrier = threading.Barrier(num_stages)
        self.slots: list[Any] = [None] * num_stages


class LocalTransport:
    """One stage of a single-replica pipeline whose stages are threads of this process."""

    def __init__(self, hub: _LocalHub, stage: int) -> None:
        self._hub = hub
        self.stage = stage
        self.num_stages = hub.num_stages
        self.replica = 0
        self.num_replicas = 1

    @staticmethod
    def group(num_stages: int, timeout: float = 60.0) -> list[LocalTransport]:
        hub = _LocalHub(num_stages, timeout)
        return [LocalTransport(hub, s) for s in range(num_stages)]

    def isend(self, array, stage, header):
        self._hub.channels[(self.stage, stage)].put((tuple(header), np.array(array, copy=True)))
        return _Done()

    def recv(self, stage, header, dtype, shape):
        try:
            got, array = self._hub.channels[(stage, self.stage)].get(timeout=self._hub.timeout)
        except queue.Empty:
            raise PipelineError(
                f"stage {self.stage} waited {self._hub.timeout:.0f}s for message {tuple(header)} "
                f"from stage {stage}, which never sent it") from None
        if got != tuple(header) or array.dtype != np.dtype(dtype) or array.shape != tuple(shape):
            raise PipelineError(
                f"stage {self.stage} expected message {tuple(header)} {np.dtype(dtype)} {tuple(shape)} "
                f"from stage {stage} but got {got} {array.dtype} {array.shape}")
        return array

    def irecv(self, stage, header, dtype, shape):
        return _Deferred(self, (stage, header, dtype, shape))

    def _exchange(self, value):
        hub = self._hub
        hub.barrier.wait(hub.timeout)
        hub.slots[self.stage] = value
        hub.barrier.wait(hub.timeout)
        everyone = list(hub.slots)
        hub.barrier.wait(hub.timeout)
        return everyone

    def pipeline_allreduce(self, array):
        parts = self._exchange(np.asarray(array))
        total = parts[0].copy()
        for part in parts[1:]:
            total = total + part
        return total

    def pipeline_broadcast_object(self, obj, root_stage):
        return self._exchange(obj)[root_stage]

    def replica_allreduce(self, array):
        return np.asarray(array)

    def replica_allgather(self, array):
        return np.asarray(array)

    def replica_broadcast(self, array):
        return np.asarray(array)


class CommTransport:
    """tnt_comm messages and the mesh's sub-communicators for one rank of a layout of
    replicas x stages (x tensor shards: messages go between the same shard of two stages)."""

    def __init__(self, mesh) -> None:
        import tnt_comm

        from .._core.mesh import groups

        self._tnt_comm = tnt_comm
        self._world = tnt_comm.world()
        self.mesh = mesh
        mine = groups(mesh)
        self.num_stages = mesh.num_pipeline_stages
        self.stage = mine.stage
        self.shard = mine.shard
        self.replica = mine.replica_index
        self.num_replicas = mesh.replicas
        self._pipe = mine.pipeline
        self._replicas = mine.replica

    def rank_of(self, stage: int) -> int:
        return self.mesh.rank_of(self.replica, stage, self.shard)

    def pipeline_allgather_object(self, obj) -> list:
        """``obj`` of every stage of this replica (same shard), in stage order."""
        return self._pipe.allgather_object(obj)

    def isend(self, array, stage, header):
        # Sent from the array's own memory (no copy): every caller sends arrays it never
        # changes (views of TensorFlow tensors, fresh buffers); the request holds them.
        return self._world.isend(np.ascontiguousarray(array), self.rank_of(stage), header=tuple(header),
                                 copy=False)

    def recv(self, stage, header, dtype, shape):
        return self.irecv(stage, header, dtype, shape).wait()

    def irecv(self, stage, header, dtype, shape):
        return self._world.irecv(self.rank_of(stage), header=tuple(header), dtype=np.dtype(dtype),
                                 shape=tuple(shape))

    def pipeline_allreduce(self, array):
        return self._pipe.allreduce(np.ascontiguousarray(array), self._tnt_comm.Op.SUM)

    def pipeline_broadcast_object(self, obj, root_stage):
        return self._pipe.broadcast_object(obj, root_stage)

    def replica_allreduce(self, array):
        if self.num_replicas == 1:
            return np.asarray(array)
        return self._replicas.allreduce(np.ascontiguousarray(array), self._tnt_comm.Op.SUM)

    def replica_allgather(self, array):
        if self.num_replicas == 1:
            return np.asarray(array)
        return self._replicas.allgather(np.ascontiguousarray(array))

    def replica_broadcast(self, array):
        if self.num_replicas == 1:
            return np.asarray(array)
        return self._replicas.broadcast(np.ascontiguousarray(array), 0)

    @property
    def replica_comm(self):
        """This stage's replica group (same stage and shard in every replica): a communicator."""
        return self._replicas

    def eager_reducer(self, threshold_bytes: int):
        """The step end over this stage's replica group (``_reducer.EagerReducer``)."""
        from .._core.reducer import EagerReducer

        return EagerReducer(self._replicas, threshold_bytes)
