"""``tnt.Model(..., parallel_strategy=TENSOR, tensor_parallel_size=t)``: one rank's shards.

Every rank of the tensor group builds the *local model*: the user's functional graph with
each split layer replaced by its shard layer (``_layers``) and every other layer reused
as it is. All ranks of the group read the same global batch, so replicated layers see
the same inputs, compute the same outputs and gradients, and the optimizer keeps them
identical without any exchange; the shards meet only in the in-graph collectives. Loss,
metrics and logs are therefore the same on every rank, and Keras' own ``train_step``,
``fit``, callbacks and History run unchanged on the wrapper (never as one XLA cluster:
the collectives cannot live inside XLA; ``jit_compile=True`` compiles the segments
between them, ``_xla``).

``TENSOR`` runs one group of N == t ranks; ``ALL`` with ``tensor_parallel_size=t`` runs
N / t data replicas of such groups (``_replicas``: each replica reads its slice of the
global batch, gradients are summed over the replica group only; ``sharding=1|2`` shards
the optimizer state, and gradients, over each replica group as DATA does; ``sharding=3``
also stores only the owned variables between steps, gathered per step in the replica group
as DATA's own train_step is: ``data_parallel.PerStepShards``), or, with
pipeline stages, pipelining's model whose stages are tensor groups (``tarantella.hybrid``).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect

import keras
import numpy as np

import tnt_comm

from .._core import backup as _backup
from .._core import inputs as _inputs
from .._core import internals as _internals
from .._core import memory as _memory
from .._core import runtime as _runtime
from .._core import settings as _settings
from .._core import sync as _sync
from .._core.compile_args import own_compile_arguments
from .._core.deferred import current_or_initial, has_deferred, is_deferred, materialise
from .._core.distributed import DistributedModel
from .._core.errors import TensorParallelError
from .._core.mesh import check_layout, groups
from ..data_parallel import GatheredStepFunctions, PerStepShards, Sharding, serial_optimizer
from . import _saving
from ._agreement import check_same_plan
from ._collectives import TensorGroup
from ._layout_map import as_plan
from ._loss_scale import decide_over_group
from ._plan import (
    check_model,
    check_size,
)
from ._replicas import ReplicaLoops
from ._sharding import shard_model, split_variables
from ._xla import compiled_segments


def digest(variables) -> str:
    """A SHA-256 of the variables' bytes, in order."""
    h = hashlib.sha256()
    for v in variables:
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()


class GroupMember:
    """What a rank of a tensor group answers (a mixin: ``group``, ``_tnt_shards``)."""

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks sharing one copy of each split layer."""
        return self.group.size

    @property
    def tensor_parallel_rank(self) -> int:
        """This rank's shard index in its tensor group."""
        return self.group.rank

    def _gather(self, local, axis: int | None) -> np.ndarray:
        """The whole of a variable (or array) split along ``axis`` over the group (collective)."""
        value = np.asarray(local.numpy() if hasattr(local, "numpy") else local)
        if axis is None or self.group.comm is None:
            return value
        whole = self.group.comm.allgather(np.ascontiguousarray(np.moveaxis(value, axis, 0)))
        return np.moveaxis(whole, 0, axis)

    def shard_checksum(self) -> str:
        """A digest of this rank's shards' bytes (equal on the ranks of its replica group)."""
        return digest([v for shard in self._tnt_shards.values() for v in shard.weights])


class TensorParallelModel(GroupMember, ReplicaLoops, GatheredStepFunctions, DistributedModel):
    """This rank's shards of a model whose large layers are split over ``t`` ranks (and,
    with ``parallel_strategy="all"``, its replica's slice of every global batch)."""

    #: compile(jit_compile=True): XLA compiles the segments between collectives (``_xla``).
    _tnt_xla_segments = False

    @property
    def jit_compile(self):
        """None (not False) while XLA compiles the segments: Keras passes this to
        ``tf.function``, whose ``jit_compile=False`` would forbid auto-clustering."""
        return None if self._tnt_xla_segments else keras.Model.jit_compile.fget(self)

    @jit_compile.setter
    def jit_compile(self, value) -> None:
        keras.Model.jit_compile.fset(self, value)

    def __init__(self, model: keras.Model, *, tensor_parallel_size: int,
                 tensor_parallel_plan=None, parallel_strategy: str = "tensor", sharding: int = 0,
                 _weights_from_file: bool = False) -> None:
        t = check_size(tensor_parallel_size)
        check_model(model)
        plan = as_plan(tensor_parallel_plan, model, t)
        mesh = check_layout(parallel_strategy, _runtime.get_size(), t)
        super().__init__(name=f"tnt_{model.name}")
        self._tnt_settings = _runtime.setup()
        self.plan = plan
        self.parallel_strategy = parallel_strategy
        self.mesh = mesh
        mine = groups(mesh)
        self.group = TensorGroup(mine.tensor)
        # None: one replica (no gradient exchange between replicas).
        object.__setattr__(self, "_tnt_replicas", mine.replica if mesh.replicas > 1 else None)
        self.num_replicas = mesh.replicas
        self.replica = mesh.replica(_runtime.get_rank())
        object.__setattr__(self, "_tnt_sharding", replica_sharding(self, sharding))
        self._tnt_check_same_plan()
        # A model built in tnt.pipelining.deferred_variables() has no values to broadcast:
        # each variable gets its initial value when its shard is made (_assign_initial).
        deferred = not _weights_from_file and has_deferred(model)
        if _runtime.get_size() > 1 and not _weights_from_file and not deferred:
            _sync.broadcast_from_master(model.weights)  # every rank starts from rank 0's weights
        # Not tracked by Keras: the wrapper's variables are the local model's only.
        object.__setattr__(self, "_serial", model)
        object.__setattr__(self, "_tnt_shards", {})
        self.local_model = self._build_local(model)
        if deferred:
            self._assign_initial()
        elif not _weights_from_file:  # else _saving.load_model reads each rank's slices
            self._assign_shards()
        self._tnt_steps = self._replica_steps()
        self.built = True

    # -- building ----------------------------------------------------------------------
    def _tnt_check_same_plan(self) -> None:
        check_same_plan(self.plan)

    def _build_local(self, model: keras.Model) -> keras.Model:
        return shard_model(model, self.plan, self.group, self._tnt_shards)

    def _split_variables(self):
        """(serial variable, local variable, split axis or None) for every serial weight."""
        return split_variables(self._serial, self._tnt_shards, self.plan)

    def _assign_shards(self) -> None:
        """Each shard gets its slice of the serial layer's weights."""
        assign_slices(self._split_variables(), self.group)

    def _assign_initial(self) -> None:
        """For a model built in ``tnt.pipelining.deferred_variables()``: no rank ever holds it
        whole. One variable at a time, the master makes a split variable's initial value
        (its initializer's, as an eager build would) and sends it to every rank, which keeps
        its slice; the replicated layers' variables get the master's initial values."""
        t, r = self.group.size, self.group.rank
        several = _runtime.get_size() > 1
        split = set()
        for serial, local, axis in self._split_variables():
            split.add(id(serial))
            if _runtime.is_master_rank() or not several:
                full = np.ascontiguousarray(current_or_initial(serial), dtype=serial.dtype)
            else:
                full = np.empty(tuple(serial.shape), dtype=serial.dtype)
            if several:
                full = tnt_comm.broadcast(full, _runtime.get_master_rank())
            local.assign(np.split(full, t, axis=axis)[r] if axis is not None else full)
            del full
        # Every other variable (replicated layers' weights, dropout seed states) in full.
        replicated = list({id(v): v for v in [*self._serial.variables, *self.local_model.variables]
                           if id(v) not in split and is_deferred(v)}.values())
        for v in replicated:
            _internals.initialize_deferred(v)
        if several:
            _sync.broadcast_from_master(replicated)

    # -- what this rank holds --------------------------------------------------------------
    def call(self, inputs, training=None):
        """The local model's forward pass (outputs identical on every rank of the group)."""
        return self.local_model(inputs, training=training)

    # -- level 3: the owned variables stored between steps, the others gathered per step ----
    def _per_step(self) -> PerStepShards | None:
        """Level 3's per-step storage on the replica group, else None."""
        return None if self._tnt_sharding is None else self._tnt_sharding.per_step

    @contextlib.contextmanager
    def _per_call(self, gather: bool = True):
        """Level 3: while inside, this rank holds its local model's whole weights (gathered
        from their owners in the replica group on entry, a collective; ``gather`` False:
        zeros, for a load to overwrite); on the outermost exit the ones other replicas own are
        freed (from the first such exit on: the replicas start alike, from construction)."""
        per_step = self._per_step()
        if per_step is None:
            yield
            return
        variables = self.trainable_variables
        with per_step.gathered(variables, gather):
            yield
        per_step.owners = list(self._tnt_sharding.owners)
        per_step.release(variables)  # nothing while an outer call holds them

    # get_weights / set_weights: the base's (serial-shaped; the master's values win).
    def _tnt_serial_weights(self) -> list[np.ndarray]:
        """The serial model's weights, shards joined over the group (collective on the group)."""
        with self._per_call():  # level 3: the replicated layers' variables are the local model's too
            gathered = {id(s): self._gather(local, axis) for s, local, axis in self._split_variables()}
            return [gathered[id(w)] if id(w) in gathered else np.asarray(w.numpy()) for w in self._serial.weights]

    def _tnt_serial_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(w.shape) for w in self._serial.weights]

    def _tnt_assign_serial(self, weights) -> None:
        """The serial layers take the list; each shard its slices of the split ones."""
        with self._per_call(gather=False):  # level 3: the replicated variables are the local model's
            materialise(self._serial)  # a loaded model's serial split layers hold no values
            self._serial.set_weights(weights)
            self._assign_shards()

    def replicated_checksum(self) -> str:
        """A digest of every replicated variable's bytes (equal on all ranks of a healthy group):
        the replicated layers' and the whole copies inside split layers (a row split's bias),
        which a rank-local decision (e.g. skipping a step) would also make drift apart."""
        shard_vars = {id(v) for shard in self._tnt_shards.values() for v in shard.weights}
        whole_in_shards = [local for _, local, axis in self._split_variables() if axis is None]
        with self._per_call():  # level 3: a collective over the replica group
            return digest([v for v in self.local_model.weights if id(v) not in shard_vars] + whole_in_shards)

    def shard_checksum(self) -> str:
        """A digest of this rank's shards' bytes (level 3: gathered first, a collective)."""
        with self._per_call():
            return super().shard_checksum()

    def verify_group(self) -> None:
        """Raise if replicated weights differ within the group (the ranks did not read the
        same batches: unseeded shuffles) or any weight differs between data replicas."""
        if _runtime.get_size() == 1:
            return
        with self._per_call():
            everyone = tnt_comm.allgather_object((self.replicated_checksum(), self.shard_checksum()))
        t = self.group.size
        if any(len({e[0] for e in everyone[g:g + t]}) != 1 for g in range(0, len(everyone), t)):
            raise TensorParallelError(
                f"replicated weights differ between the ranks of the tensor group (rank {_runtime.get_rank()}): "
                "the ranks did not train on the same batches. Every rank must read the same global batch "
                "in the same order: seed shuffles (keras.utils.set_random_seed(s) before building the "
                "data, or dataset.shuffle(n, seed=s)).")
        if any(everyone[r] != everyone[r % t] for r in range(len(everyone))):
            raise TensorParallelError(
                f"weights differ between the data replicas (rank {_runtime.get_rank()}): the replicas did not "
                "apply the same reduced gradients. Every rank must build the same model and call the same "
                "methods with the same arguments.")

    def _tnt_summary(self, *args, **kwargs) -> None:
        self.plan.summary()

    # -- compile / run ---------------------------------------------------------------------
    def compile(self, *args, **kwargs):
        """Keras' compile of the local model's wrapper, with the arguments the user's
        model's own ``compile`` passes on (its defaults: keras-hub's metrics). The group
        collectives are ops XLA cannot hold, so the step is never one XLA cluster;
        ``jit_compile=True`` has XLA compile the segments between them instead (``_xla``).
        Sharded replicas: the optimizer is built on the owned variables only. A
        LossScaleOptimizer decides to skip a step on the whole gradients (``_loss_scale``)."""
        serial = self._serial
        kwargs = own_compile_arguments(type(serial), lambda: serial, args, kwargs)
        optimizer = keras.optimizers.get(kwargs.pop("optimizer"))
        jit_compile = kwargs.pop("jit_compile")
        if self.plan.split_layers() and (getattr(optimizer, "clipnorm", None) or
                                         getattr(optimizer, "global_clipnorm", None)):
            raise TensorParallelError(
                "clipnorm/global_clipnorm compute norms of whole gradients, but a rank holds only shards "
                "of the split layers' gradients. Use clipvalue=, or train with ParallelStrategy.DATA.")
        self._tnt_xla_segments = jit_compile is True
        super().compile(optimizer=optimizer, jit_compile=False, **kwargs)
        if self._tnt_sharding is not None:  # its LossScaleOptimizer decides over the job
            per_step = self._per_step()
            if per_step is not None:  # level 3: whole until the next step frees them (new owners)
                per_step.gather()
            self._tnt_sharding.install(self.optimizer)
            self._tnt_sharding.owned_variables()  # too few variables to own: a ShardingError now, not in fit
        else:  # a LossScaleOptimizer skips or applies on whole gradients, as serial (_loss_scale)
            decide_over_group(self.optimizer, self.group)
        if self._tnt_steps is not None:  # its reducers hold the old metrics' and optimizer's slots
            self._tnt_steps.close()
            self._tnt_steps = self._replica_steps()

    # Keras' steps on one tensor group; the data-parallel steps over the replica group.
    def train_step(self, data):
        """Keras' step (one replica) or the data-parallel step over the replica group."""
        return super().train_step(data) if self._tnt_steps is None else self._tnt_steps.train_step(data)

    def test_step(self, data):
        """Keras' step (one replica) or the data-parallel step over the replica group."""
        return super().test_step(data) if self._tnt_steps is None else self._tnt_steps.test_step(data)

    def predict_step(self, data):
        """Keras' step (one replica) or the data-parallel step over the replica group."""
        return super().predict_step(data) if self._tnt_steps is None else self._tnt_steps.predict_step(data)

    def _tnt_memory_layout(self) -> _memory.Holdings:
        """This rank's shards and replicated layers (the model of shards)."""
        batch = getattr(self, "_tnt_memory_global_batch", None)
        return _memory.Holdings(
            model=self.local_model, optimizer=self.optimizer if self.compiled else None,
            what=f"TENSOR, shard {self.group.rank} of {self.group.size}, {self.num_replicas} replica(s)",
            rows=-(-batch // self.num_replicas) if batch else None,
            comm_gradient_sets=1 if self.num_replicas > 1 else 0)

    def fit(self, *args, **kwargs):
        """Keras' fit on every rank of the group (same batches everywhere; with data
        replicas, the replica's slice of each global batch); afterwards the replicated
        weights are checked to be identical across the group, and every weight across
        the replicas. Without replicas, a BackupAndRestore callback writes from the master
        (``_backup``), other writing callbacks run as in data parallelism
        (``_rank_callbacks``) and progress prints on the master only."""
        self._tnt_memory_before_fit(args[0] if args else kwargs.get("x"),
                                    args[2] if len(args) > 2 else kwargs.get("batch_size"))
        with compiled_segments(self._tnt_xla_segments):
            try:
                history = self._fit(*args, **kwargs)
            finally:
                self._average_replica_statistics()
        self.verify_group()
        return history

    def _average_replica_statistics(self) -> None:
        """Batch-norm moving statistics averaged over the data replicas (each tracks its own
        slices; identical within a tensor group, which reads one batch): before evaluate,
        save and at the end of fit, so every replica holds one model, as in DATA."""
        if self._tnt_replicas is not None:
            replicas = self._tnt_replicas
            _sync.average_moving_statistics(
                self.local_model, lambda a: replicas.allreduce(np.ascontiguousarray(a), tnt_comm.Op.SUM),
                replicas.size)

    def _tnt_before_save(self) -> None:
        self._average_replica_statistics()

    def _fit(self, *args, **kwargs):
        if self._tnt_replicas is not None:
            return self._fit_replicas(*args, **kwargs)
        kwargs = inspect.signature(keras.Model.fit).bind(self, *args, **kwargs).arguments
        kwargs.pop("self")
        callbacks, backup = _backup.adapt(kwargs.get("callbacks"))
        if backup is not None:
            restored = backup.restore(self)
            if restored is not None:
                kwargs["initial_epoch"] = restored
        if not _runtime.is_master_rank():
            kwargs["verbose"] = 0
        with self._rank_callbacks(callbacks) as kwargs["callbacks"]:
            if _internals.global_seed() is not None:
                history = super().fit(**kwargs)
            else:
                # Without a global seed Keras would shuffle arrays differently on every rank of
                # the group; all of them must read the same batches.
                with _internals.temporary_global_seed(_inputs.next_array_shuffle_seed(self._common_seed())):
                    history = super().fit(**kwargs)
        return history

    def evaluate(self, *args, **kwargs):
        """Keras' evaluate; with data replicas over the union of their slices (global metrics)."""
        with compiled_segments(self._tnt_xla_segments):
            self._average_replica_statistics()
            with self._per_call():  # level 3: gathered once for the whole call
                if self._tnt_replicas is None or _internals.is_cached_eval_call(kwargs):
                    return super().evaluate(*args, **kwargs)
                return self._evaluate_replicas(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """Keras' predict; with data replicas every rank returns the whole predictions."""
        with compiled_segments(self._tnt_xla_segments):
            with self._per_call():  # level 3: gathered once for the whole call
                if self._tnt_replicas is None:
                    return super().predict(*args, **kwargs)
                return self._predict_replicas(*args, **kwargs)

    # -- files (the base writes them, see _core.distributed; reading: _saving) ---------------
    def load_weights(self, filepath, *args, **kwargs) -> None:
        """Load a serial weights file (saved at any t): this rank reads its slices only."""
        with self._per_call(gather=False):
            _saving.load_weights(self, filepath)

    def _write(self, *args, **kwargs) -> None:
        """A file (save, save_weights, export's gather, a backup): level 3 holds the whole
        weights while it is written (a collective over the replica group)."""
        with self._per_call():
            super()._write(*args, **kwargs)

    def _tnt_gather_serial(self, with_optimizer: bool = True) -> keras.Model | None:
        """The serial model with optimizer state on the master (None elsewhere); all ranks
        call it (BackupAndRestore writes it). Sharded replicas first stream their slots to
        replica 0 of their group, whose shards are then joined as unsharded ones (level 3:
        from the whole weights, gathered for it)."""
        if self._tnt_sharding is None or not with_optimizer or not self.compiled:
            with self._per_call():
                return _saving.gather_serial_model(self, with_optimizer)
        with self._per_call(), serial_optimizer(self, self._tnt_sharding, gather=True):
            return _saving.gather_serial_model(self, with_optimizer)

    def _tnt_streamed(self, kind: str, with_optimizer: bool):
        """The serial file written by the master array by array, each split variable joined
        from the group's slices just before it is written (``_saving.streamed_save``); all
        ranks call it. Sharded replicas first join their slots on replica 0 of their group."""
        if self._tnt_sharding is None or not with_optimizer or not self.compiled:
            return _saving.streamed_save(self, kind, with_optimizer)
        with serial_optimizer(self, self._tnt_sharding, gather=True):
            return _saving.streamed_save(self, kind, with_optimizer)


def replica_sharding(tpm: TensorParallelModel, level: int) -> Sharding | None:
    """DATA's shards over ``tpm``'s replica group (the ranks holding the same shard): each of
    its trainable variables, shards and replicated ones alike, has one owner there. None at
    level 0 or with one replica. The loss-scale decision spans the job."""
    if not level or tpm._tnt_replicas is None:
        return None
    shards = Sharding(tpm, level, comm=tpm._tnt_replicas, decisions=tnt_comm.world(),
                      bucket_bytes=_settings.load().fusion_threshold_bytes)
    if level == 3:  # the step is level 2's; the weights are gathered per step around it
        shards.per_step = PerStepShards(shards.comm, shards.bucket_bytes,
                                        "parallel_strategy=ALL, tensor_parallel_size>1, sharding=3",
                                        " of its tensor shard's replica group")
    return shards


def assign_slices(pairs, group: TensorGroup) -> None:
    """Each shard variable gets this rank's slice of its whole variable."""
    for whole, local, axis in pairs:
        full = np.asarray(whole.numpy())
        local.assign(np.split(full, group.size, axis=axis)[group.rank] if axis is not None else full)


__all__ = ["TensorParallelModel", "assign_slices", "shard_model", "split_variables"]
