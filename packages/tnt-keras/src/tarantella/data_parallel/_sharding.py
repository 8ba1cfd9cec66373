"""Sharded data parallelism (ZeRO stages 1 and 2): each replica keeps the optimizer state of
the variables it owns, and at level 2 receives only their summed gradients.

Why whole variables: Keras optimizers keep one slot per variable (``build(var_list)``) and
update each variable from its own gradient, so building and applying the optimizer on the
owned subset gives serial Keras' update for those variables — exactly, with no change to
the optimizer. What crosses variables is made global here: ``global_clipnorm`` (the squared
norms of the owned gradients are summed over the replicas) and a LossScaleOptimizer's
finiteness decision (one allreduce, so every replica skips or applies alike). After the
update each owner's new values are allgathered, so every replica holds identical weights.

Level 1: gradients are allreduced as at level 0; level 2: reduce-scatters hand each replica
only the sums of its own gradients (docs/sharding.md). Both collectives move buckets of at
most ``bucket_bytes`` one after the other (``_core.shard_buckets``), never a whole copy.
Level 3 (parameters too) gathers each leaf layer's weights around its call instead
(``_layer_shards``); what it keeps whole takes level 2's path here. A model's own
``train_step`` (levels 1-2) is sharded per optimizer over the variables it applies to
(:meth:`Sharding.for_optimizer`, called from ``_grad_sync``'s intercepted ``apply``).
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

import tnt_comm

from .._core import graph_collectives as _gc
from .._core import sparse as _sparse
from .._core.serial_updates import update_one_variable_at_a_time
from .._core.shard_buckets import BUCKET_BYTES, cut_into_buckets
from ._update_release import release_buckets


class ShardingError(ValueError):
    """A model, optimizer or option that sharded data parallelism cannot train exactly."""


#: Keras optimizers whose update of a variable reads only that variable's gradient and
#: slots (element-wise, or per whole variable such as Lamb's trust ratio or Muon).
_PER_VARIABLE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam",
                 "Ftrl", "Lion", "Lamb", "Adafactor", "Muon")


def assign_owners(nbytes: Sequence[int], size: int) -> list[int]:
    """The owning replica of each variable: largest first onto the least loaded replica
    (ties: lower index, lower rank). A pure function of the sizes and ``size``."""
    loads = [0] * size
    owners = [0] * len(nbytes)
    for i in sorted(range(len(nbytes)), key=lambda i: (-int(nbytes[i]), i)):
        r = min(range(size), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += int(nbytes[i])
    return owners


def _nbytes(v) -> int:
    return int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size


def _target(optimizer):
    """The optimizer that updates the variables (a LossScaleOptimizer's inner one)."""
    return optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer


def check_optimizer(optimizer, level: int) -> None:
    """Refuse, on every rank alike (a pure function of the optimizer), what sharding cannot
    keep exact."""
    target = _target(optimizer)
    name = type(target).__name__
    known = getattr(keras.optimizers, name, None) is type(target) and name in _PER_VARIABLE
    if not known and not getattr(type(target), "tnt_per_variable", False):
        raise ShardingError(
            f"tnt.Model(sharding={level}): optimizer {name} is not known to update each variable "
            "from its own gradient and slots alone, so it cannot be applied to a shard. Use "
            f"sharding=0, one of Keras' {', '.join(_PER_VARIABLE)}, or (if it is per-variable) set "
            f"the class attribute {name}.tnt_per_variable = True.")
    if target.global_clipnorm and target.gradient_accumulation_steps:
        raise ShardingError(
            f"tnt.Model(sharding={level}): global_clipnorm with gradient_accumulation_steps needs "
            "the global norm of accumulated gradients, which no replica holds; use sharding=0, "
            "or clipnorm= (per variable) instead of global_clipnorm=.")


def _other_variables(optimizer, level: int) -> ShardingError:
    return ShardingError(
        f"tnt.Model(sharding={level}): optimizer {type(optimizer).__name__} of the train_step is applied "
        "to other variables than those its slots were built for (each replica builds them on its owned "
        "share of one list: the first its step applies it to, or the model's trainable variables for "
        "the compiled optimizer, which fit builds first). Apply each optimizer to the same variables, in "
        "the same order, every step (a separate optimizer for a subset), or use sharding=0.")


class Sharding:
    """One wrapped model's shards: who owns which trainable variable, the optimizer built on
    the owned ones, the level-2 reduce-scatter and the allgather of updated values."""

    def __init__(self, model: keras.Model, level: int, comm: tnt_comm.Communicator | None = None,
                 decisions: tnt_comm.Communicator | None = None, bucket_bytes: int = BUCKET_BYTES,
                 variables: Sequence | None = None) -> None:
        """``bucket_bytes``: the most bytes one allgather (of values) or reduce-scatter (of
        gradients) moves at once (``shard_buckets``). ``variables``: what is shared out, when
        not the model's trainable variables (one optimizer's, in a user's own step)."""
        self.model = model
        self._fixed_variables = None if variables is None else list(variables)
        # An own train_step: one Sharding per optimizer, over the variables it applies to.
        self._per_optimizer: dict[int, tuple[object, Sharding]] = {}
        self.bucket_bytes = bucket_bytes
        self.level = level
        self.comm = comm or tnt_comm.world()
        # The ranks whose loss-scale decision must agree: ``comm`` for DATA; the whole job for
        # the replicas of tensor groups, whose shards' gradients differ between the group's ranks.
        self.decisions = decisions or self.comm
        self.rank, self.size = self.comm.rank, self.comm.size
        self._owners: list[int] | None = None
        self._variable_ids: list[int] = []  # id() of the variables the owners were assigned for
        self._installed: object | None = None  # the optimizer patched for shards
        # Level 3: the per-layer plan and the released variables (_layer_shards.LayerShards);
        # or, for a model's own train_step, the weights gathered per step (_per_step.PerStepShards).
        self.layers = None
        self.per_step = None

    # -- ownership ------------------------------------------------------------------------------
    @property
    def variables(self) -> list:
        """The variables shared out over the replicas (in the order ownership is assigned)."""
        return self.model.trainable_variables if self._fixed_variables is None else self._fixed_variables

    @property
    def owners(self) -> list[int]:
        """Owner of each of the model's trainable variables (in their order)."""
        if self._owners is None:
            variables = self.variables
            what = "the model has" if self._fixed_variables is None else "an optimizer of its train_step updates"
            if len(variables) < self.size:
                raise ShardingError(
                    f"tnt.Model(sharding={self.level}) gives each of the {self.size} replicas whole "
                    f"variables to own, but {what} only {len(variables)} trainable variables; "
                    "use sharding=0 or fewer ranks.")
            self._owners = assign_owners([_nbytes(v) for v in variables], self.size)
            self._variable_ids = [id(v) for v in variables]
        return self._owners

    def owned_mask(self) -> list[bool]:
        """For each trainable variable (in the model's order): whether this replica owns it."""
        return [o == self.rank for o in self.owners]

    def owned_variables(self) -> list:
        """The trainable variables this replica updates (its optimizer is built on them only)."""
        return [v for v, o in zip(self.variables, self.owners) if o == self.rank]

    def bucket_count(self) -> int:
        """How many allgathers of updated values one step runs (buckets of ``bucket_bytes``)."""
        return len(self._groups())

    def bytes_per_rank(self) -> list[int]:
        """Bytes of trainable variables each replica owns: how even the assignment is."""
        loads = [0] * self.size
        for v, o in zip(self.variables, self.owners):
            loads[o] += _nbytes(v)
        return loads

    # -- the optimizer ---------------------------------------------------------------------------
    def for_optimizer(self, optimizer, variables: Sequence) -> Sharding:
        """The shards of one optimizer of a user's own ``train_step``: ownership over the
        variables it applies to (a pure function of their sizes and d, so the same on every
        rank), its slots built on the owned ones, installed as :meth:`install` does. The
        compiled optimizer applied to the model's trainable variables keeps the model's."""
        ids = tuple(id(v) for v in variables)
        if optimizer is self._installed and ids == tuple(id(v) for v in self.variables):
            return self
        held = self._per_optimizer.get(id(optimizer))
        if held is not None and held[0] is optimizer:
            if tuple(id(v) for v in held[1].variables) != ids:
                raise _other_variables(optimizer, self.level)
            return held[1]
        shards = Sharding(self.model, self.level, self.comm, self.decisions, self.bucket_bytes, variables)
        if optimizer.built:  # on every rank alike (which share it was built on is not)
            raise _other_variables(optimizer, self.level)
        shards.install(optimizer)
        self._per_optimizer[id(optimizer)] = (optimizer, shards)
        return shards

    def own_step_optimizers(self) -> list[tuple[object, Sharding]]:
        """The optimizers a user's own ``train_step`` applied with their own shares (not the
        compiled one on the model's variables), each with its :class:`Sharding`."""
        return list(self._per_optimizer.values())

    def install(self, optimizer) -> None:
        """Make ``optimizer`` build on the owned variables only (its slots are the memory
        saved), decide finiteness globally and clip by the global norm."""
        if optimizer is None or self._installed is optimizer:
            return
        check_optimizer(optimizer, self.level)
        if self.layers is not None and self.layers.released():
            old = (list(self.owners), list(self._variable_ids))
            self._owners = None
            if (self.owners, self._variable_ids) != old:
                raise ShardingError(
                    "tnt.Model(sharding=3): the trainable variables changed (a layer's trainable flag?) "
                    "after the replicas released the weights they do not own; set trainable flags "
                    "before wrapping the model, or use sharding<=2.")
        self._owners = None  # a new compile: trainable variables may have changed
        self._per_optimizer.clear()
        sharding = self
        cls_build = type(optimizer).build

        def build(opt, variables):
            # In the shared variables' order, whatever order the first apply hands them in (at
            # level 2, the update's): the slots' order is the files' (Sharding.apply).
            given = {id(v) for v in variables}
            owned = [v for v in sharding.owned_variables() if id(v) in given]
            return cls_build(opt, owned)

        optimizer.build = types.MethodType(build, optimizer)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            cls_check = type(optimizer).check_finite

            def check_finite(opt, grads):
                bad = tf.reshape(tf.cast(tf.logical_not(cls_check(opt, grads)), tf.float32), [1])
                total = _gc.allreduce(bad, sharding.decisions, "tnt_sharding", "tnt_shard_finite")
                return tf.equal(total[0], 0.0)

            optimizer.check_finite = types.MethodType(check_finite, optimizer)
        target = _target(optimizer)
        if target.global_clipnorm:
            target._clip_gradients = types.MethodType(self._clip_by_global_norm, target)
        if self.level == 2:  # Note [Level 2's update bucket by bucket]
            update_one_variable_at_a_time(optimizer)
        self._installed = optimizer

    def _clip_by_global_norm(self, opt, grads):
        """Keras' clip_by_global_norm with the norm of all replicas' gradients: the squared
        norms of the owned ones, summed over the replicas."""
        squares = [tf.cast(tf.reduce_sum(tf.square(_sparse.to_dense(g) if _sparse.is_sparse(g) else g)),
                           tf.float32) for g in grads if g is not None]
        local = tf.add_n(squares) if squares else tf.zeros((), tf.float32)
        total = _gc.allreduce(tf.reshape(local, [1]), self.comm, "tnt_sharding", "tnt_shard_norm")[0]
        use_norm = tf.sqrt(total)
        clip_norm = opt.global_clipnorm
        scale_for_finite = clip_norm * tf.minimum(1.0 / use_norm, 1.0 / clip_norm)
        scale = scale_for_finite + (use_norm - use_norm)  # NaN for a non-finite norm, as Keras
        return [g if g is None else g * tf.cast(scale, g.dtype) for g in grads]

    def apply(self, optimizer, grads: Sequence, variables: Sequence, after: Sequence[tf.Tensor] = (),
              settled: Sequence[tf.Tensor] = ()) -> tf.Tensor:
        """Apply the owned gradients, then allgather the updated values (after ``after``: the
        step's earlier collectives, see :meth:`reduce_scatter`; and after ``settled``: every
        result of the step's fused allreduce, owned or not); returns a token."""
        owned = self.owned_mask()
        early = self.updates_during_backprop(optimizer)
        sparse = frozenset(i for i, g in enumerate(grads) if _sparse.is_sparse(g))
        pairs = [(grads[i], variables[i]) for i in self._update_order(early, sparse) if owned[i]]
        # The update's own collectives (global norm, finiteness) after the step's earlier ones:
        # a replica owning only sparse gradients reads no output of the reduce-scatter. Without
        # such collectives each update waits only for its own sum (Note [Level 2's update
        # during backprop]).
        with tf.control_dependencies([] if early else list(after)):
            optimizer.apply_gradients(pairs)
        # A sparse gradient this replica does not own was gathered by its own collective, which
        # nothing here reads: without this edge the values' allgather could run before it on
        # one replica and after it on another (a mismatched collective, seen with Embedding).
        gathered = [tf.size(g.values) for g, mine in zip(grads, owned) if not mine and _sparse.is_sparse(g)]
        # The allgathers block a thread in MPI: they start only once every bucket of the
        # step's fused allreduce was waited for on this replica — also those holding only
        # gradients it does not own, which no update reads (else one replica can block in an
        # allgather while the other still waits for a bucket it has not launched: a hang).
        dense = [g for g in grads if g is not None and not _sparse.is_sparse(g)]
        # Read after the update (its last write): every collective of apply came before.
        return self.gather_values(after=[tf.identity(optimizer.iterations), *gathered, *after],
                                  settled=[*dense, *settled])

    # Note [Level 2's update bucket by bucket]
    # At level 2 every owned gradient sum has arrived (reduce-scatters during backprop) before
    # the update begins. Left to TensorFlow's executor, the owned variables' updates ran
    # interleaved: Adam's full-size temporaries of several variables alive at once, and every
    # owned sum alive until the update reading it ran (the step's peak stood in the update,
    # docs/sharding.md "Memory and speed"). So at level 2 the updates run one variable at a
    # time (``serial_updates``), in the order of the values' allgather buckets
    # (``_update_order``): one variable's temporaries at a time, each owned sum freed once its
    # variable is updated, and a bucket's allgather (which reads its variables, so waits for
    # their writes) never waits for a later bucket's updates. The arithmetic is unchanged
    # (bitwise), so are global_clipnorm's and the loss scale's decisions (taken inside
    # apply_gradients before any update) and the collectives' order. Dropping the first
    # allgather's wait on ``iterations`` as well (where apply runs no collective) measured the
    # same peak (docs/sharding.md): every update reads ``iterations`` first, so it cost nothing.
    # Where apply runs no collective, the updates need not wait for every sum at all: Note
    # [Level 2's update during backprop] (then in the reduce-scatters' order instead).
    #
    # Note [Level 2's update during backprop]
    # Where ``apply`` runs no collective of its own (no global_clipnorm, no LossScaleOptimizer:
    # neither needs every owned sum before any update), each owned variable's update waits only
    # for its own sum (and, through serial_updates' chain, the update before it), not for the
    # last reduce-scatter: the updates run in the reduce-scatters' order (scatter_buckets), each
    # as soon as its bucket's sums arrive, i.e. during backprop, and each sum is freed then. Before,
    # every owned sum stood beside the last buckets' local gradients at the end of backprop
    # (the step's peak, docs/sharding.md "Memory and speed"). Still exact: Keras' one ``apply``
    # (``iterations`` advances once, after every update reading it), the backward pass reads the
    # forward's values (a variable written while its read is still held is copied, not changed
    # in place), and the allgathers of values keep waiting for the last reduce-scatter (the
    # collectives' order is unchanged). Each update starts no earlier than its release point
    # (Note [Level 2's updates released in step], ``_update_release``): where the replicas have
    # equal work to do, so none waits at the next reduce-scatter for another's update.
    def updates_during_backprop(self, optimizer) -> bool:
        """Whether ``optimizer``'s updates may start before the last reduce-scatter ended
        (Note [Level 2's update during backprop])."""
        return (self.level == 2 and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
                and not _target(optimizer).global_clipnorm)

    def _update_order(self, early: bool = False, sparse: frozenset[int] = frozenset()) -> list[int]:
        """Positions in the order their updates run: at level 2 that of the reduce-scatters
        (of all but the ``sparse`` positions) when the updates run during backprop (``early``,
        Note [Level 2's update during backprop]), else that of the values' buckets; then any
        not in them. So bucket by bucket. At other levels the variables' own order."""
        if self.level != 2:
            return list(range(len(self.variables)))
        if early:
            dense = [i for i in range(len(self.variables)) if i not in sparse]  # as _steps scatters them
            order = [i for _, idx in self.scatter_buckets(dense) for i in idx]
        else:
            order = [i for _, idx in self._groups() for i in sorted(idx)]
        return order + sorted(set(range(len(self.variables))) - set(order))

    # -- collectives -----------------------------------------------------------------------------
    def _groups(self, positions: Sequence[int] | None = None) -> list[tuple[tf.DType, list[int]]]:
        """Buckets of variable indices (``positions``, default all), one dtype each, cut into
        consecutive runs of at most ``bucket_bytes`` (``shard_buckets``); each bucket ordered by
        (owner, index): the wire layout."""
        variables = self.variables
        if positions is None:  # level 3: the per-layer variables are gathered layer by layer
            positions = range(len(variables)) if self.layers is None else self.layers.whole_positions()
        positions = list(positions)
        dtypes: list[tf.DType] = []
        for i in positions:
            if tf.as_dtype(variables[i].dtype) not in dtypes:
                dtypes.append(tf.as_dtype(variables[i].dtype))
        out = []
        for dt in dtypes:
            idx = [i for i in positions if tf.as_dtype(variables[i].dtype) == dt]
            for bucket in cut_into_buckets(idx, [_nbytes(variables[i]) for i in idx], self.bucket_bytes):
                out.append((dt, sorted(bucket, key=lambda i: (self.owners[i], i))))
        return out

    def gather_values(self, after: Sequence[tf.Tensor] = (), settled: Sequence[tf.Tensor] = ()) -> tf.Tensor:
        """Every owner's updated values to every replica: one allgather per bucket, each
        after the one before (so a replica holds one bucket's copy at a time, and every
        replica runs them in the same order), the first after ``settled`` too."""
        variables = self.variables
        token = tf.zeros((), tf.int32)
        comm = self.comm
        for n, (dt, idx) in enumerate(self._groups()):
            mine = [i for i in idx if self.owners[i] == self.rank]
            # Copy the bucket out only when its turn comes.
            with tf.control_dependencies([token, *(settled if n == 0 else ())]):
                flat = tf.concat([tf.reshape(variables[i].value, [-1]) for i in mine], 0) if mine \
                    else tf.zeros([0], dt)
            def gather(a, *_tokens):
                whole = comm.allgather(np.ascontiguousarray(a))
                return whole, np.int32(whole.size)

            # The token is the collective's own output: ``tf.size`` of its (static-shaped) result
            # would be folded to a constant, and the next bucket's allgather could then run
            # before this one on one replica and after it on another (a hang, seen with 7 buckets).
            with tf.control_dependencies(settled if n == 0 else ()):
                whole, token = tf.numpy_function(gather, [flat, token, *after], [dt, tf.int32], stateful=True,
                                                 name="tnt_shard_allgather")
            token.set_shape([])
            sizes = [int(np.prod(variables[i].shape)) for i in idx]
            whole.set_shape([sum(sizes)])
            written = []
            for i, piece in zip(idx, tf.split(whole, sizes) if len(sizes) > 1 else [whole]):
                if self.owners[i] != self.rank:
                    variables[i].assign(tf.reshape(piece, variables[i].shape))
                    written.append(tf.identity(variables[i].value))  # read after the write
            # The next bucket's copy and allgather after these writes: else the executor may run
            # the next allgather first and hold every received bucket to the step's end.
            with tf.control_dependencies(written):
                token = tf.identity(token)
        return token

    def scatter_buckets(self, positions: Sequence[int]) -> list[tuple[tf.DType, list[int]]]:
        """Level 2's reduce-scatter buckets of ``positions``, in the order they go on the wire:
        cut in backprop order (the last variable first, as backprop produces them), then the
        large buckets (at least half of ``bucket_bytes``) before the small ones. Why: the chain
        of reduce-scatters runs in this order on every replica, each as soon as its gradients
        exist; a bias' gradient (a small reduction the executor tends to compute last) would
        otherwise hold up every kernel behind it, and the kernels' local gradients would live
        until backprop ended (Note [Reduce-scatter during backprop] in ``_steps``)."""
        groups = self._groups(sorted(positions, reverse=True))
        variables = self.variables

        def large(idx: list[int]) -> bool:
            return sum(_nbytes(variables[i]) for i in idx) * 2 >= self.bucket_bytes

        return [g for g in groups if large(g[1])] + [g for g in groups if not large(g[1])]

    def reduce_scatter(self, dense: dict[int, tf.Tensor], has_data,
                       after: Sequence[tf.Tensor]) -> tuple[dict[int, tf.Tensor], list[tf.Tensor]]:
        """Level 2: the SUM over replicas of the owned ones of ``dense`` (variable index ->
        gradient); zeros are sent by a replica without data. One collective per bucket
        (:meth:`scatter_buckets`), each after ``after``, the one before and its own gradients
        only, so it starts during backprop and the bucket's local gradients are freed then
        (kept out of tf.function's chain of side effects too, as the reducer's waits: its
        order comes from these inputs alone). Also returns a token of the last
        reduce-scatter (a scalar: an empty output could be folded away): a replica owning none
        of these gradients (only sparse ones, an Embedding) reads no output of the collective,
        and without this edge its allgather of values could start on another thread while the
        reduce-scatter still runs (two collectives at once on one communicator, mismatched on
        the other replicas: seen on 2 ranks with an Embedding owned alone)."""
        comm = self.comm
        out: dict[int, tf.Tensor] = {}
        token = list(after)
        done: list[tf.Tensor] = []
        acd = None
        if not tf.executing_eagerly():
            acd = getattr(tf.compat.v1.get_default_graph(), "experimental_acd_manager", None)
        buckets = self.scatter_buckets(list(dense))
        release = release_buckets([idx for _, idx in buckets], self.owners,
                                  {i: int(np.prod(g.shape)) for i, g in dense.items()}, self.size)
        finished_by_bucket: list[tf.Tensor] = []
        for dt, idx in buckets:
            sizes = [int(np.prod(dense[i].shape)) for i in idx]
            counts = [sum(s for i, s in zip(idx, sizes) if self.owners[i] == r) for r in range(self.size)]
            with tf.control_dependencies(done):  # one bucket's copy at a time, in the same order everywhere
                flat = tf.concat([tf.reshape(tf.cast(dense[i], dt), [-1]) for i in idx], 0)

            def scatter(buf, keep, *_tokens, counts=counts):
                buf = np.ascontiguousarray(buf) if keep else np.zeros_like(buf)
                mine = comm.reduce_scatter(buf, counts)
                return mine, np.int32(mine.size)

            mine, finished = tf.numpy_function(scatter, [flat, has_data, *token], [dt, tf.int32], stateful=True,
                                               name="tnt_shard_reduce_scatter")
            if acd is not None:  # ordered by its inputs only (the token chain), as the reducer's waits
                acd.run_independently(mine.op)
            finished.set_shape([])
            own = [i for i in idx if self.owners[i] == self.rank]
            own_sizes = [int(np.prod(dense[i].shape)) for i in own]
            mine.set_shape([sum(own_sizes)])
            for i, piece in zip(own, tf.split(mine, own_sizes) if len(own) > 1 else [mine]):
                out[i] = tf.reshape(piece, dense[i].shape)
            token = done = [finished]
            finished_by_bucket.append(finished)
        # Each update may start only at its release point (Note [Level 2's updates released in
        # step]): its sum passes through an identity that waits for that bucket's end.
        for i in list(out):
            with tf.control_dependencies([finished_by_bucket[release[i]]]):
                out[i] = tf.identity(out[i], name=f"tnt_shard_release_{i}")
        return out, done
