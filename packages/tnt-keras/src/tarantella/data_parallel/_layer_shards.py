"""Sharding level 3 (ZeRO-3 / FSDP): a replica stores only the trainable variables it owns.

Why per layer: a Keras leaf layer reads its weights only inside its own ``call``. Running
that call under ``keras.StatelessScope(state_mapping=...)`` with values allgathered just
before it gives the layer its whole weights for exactly that call, while the variables of
other replicas hold no memory between calls. The backward pass is a ``tf.custom_gradient``
around (gather + call) that keeps none of the gathered tensors: it gathers again when
backprop reaches the layer, recomputes the call (same non-trainable and seed state) under a
tape, and reduce-scatters the weight gradients so each owner receives their sum over the
replicas (as level 2 does after backprop, here layer by layer).

Every collective of a step is chained on the previous one's own output token in trace
order (the same on every replica), as ``Sharding.gather_values`` chains its buckets, and runs
on the replica's one communication worker in that order (``_prefetch.py``). A gather is
started one layer ahead: the next layer's while this one computes (forward), the previous
layer's while this one's backward runs; at most two gathered layers exist at once.

What stays whole on every replica (level 2's treatment: the owner updates, then its values
are allgathered): variables of ``Embedding`` layers (sparse gradients), variables with a
regularizer (Keras reads them outside the layer's call), variables of layers that also
hold sublayers with weights or of a synchronised batch norm, and any variable shared by
two layers (docs/sharding.md, "Level 3").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from .._core import deferred as _deferred
from .._core import internals as _internals
from .._core.batch_norm import has_sync_batch_norm
from ._prefetch import CommWorker, Pending, predict_next
from ._sharding import ShardingError


class ReleasedWeight:
    """The initializer a released (level-3) variable reads through (``KerasVariable.value``
    calls it when the variable holds no value): zeros under Keras' shape inference, else an
    error naming the fix — never the initializer's values in place of the trained ones.
    ``layout`` and ``group`` name where it was released (DATA's replicas, or those of an ALL
    pipeline stage)."""

    def __init__(self, path: str, owner: int, layout: str = "sharding=3", group: str = "") -> None:
        self.path, self.owner, self.layout, self.group = path, owner, layout, group

    def __call__(self, shape, dtype=None):
        if _internals.in_symbolic_scope():
            return tf.zeros(shape, dtype)
        raise ShardingError(
            f"tnt.Model({self.layout}): variable {self.path} is stored on replica {self.owner}{self.group} "
            "only (it is gathered inside tnt's steps). Read the weights with the tnt.Model's "
            "get_weights(), write them with its save()/save_weights(), or use sharding<=2 to keep "
            "whole weights on every replica.")


class _StepState:
    """One traced step's level-3 state: the last collective's token and whether this replica
    has data (the loss is already weighted by b_r / B: its gradients are reduce-scattered as
    they come)."""

    def __init__(self, has_data=None) -> None:
        self.token = tf.zeros((), tf.int32)
        self.has_data = tf.constant(True) if has_data is None else has_data
        self.backward = True  # a training step: gradients are reduce-scattered
        # An input of every layer call that backprop differentiates on every replica: without
        # it a replica owning no weight of the first layers (whose inputs need no gradient)
        # would never run their backward collectives while the owners do (a hang, 3 ranks).
        self.anchor = tf.zeros((), tf.float32)
        self.calls: list = []  # the planned layer of each forward call, in call order
        self.pending: Pending | None = None  # a started gather no call waited for yet


@dataclass(frozen=True)
class _Layout:
    """How one layer's weights travel: positions in wire order (by owner, then position),
    their sizes, the owned positions, elements per replica, the stored dtype."""

    order: list[int]
    sizes: list[int]
    mine: list[int]
    counts: list[int]
    dtype: tf.DType


class LayerShards:
    """The per-layer plan of one wrapped model at level 3 (see the module docstring)."""

    def __init__(self, sharding) -> None:
        self.sharding = sharding
        self.model = sharding.model
        self._plan: dict[int, list[int]] | None = None  # id(layer) -> variable positions
        self._layers: list = []
        self._hooked: list = []
        self._released: dict[int, object] = {}  # id(variable) -> variable, values dropped
        # Whether the replicas released what they do not own: the same on every replica (one
        # may own every per-layer variable and release none), so collectives branch on it.
        self._sharded = False
        self._state: _StepState | None = None
        self._order: list = []  # the last traced step's forward calls (what prefetch predicts)
        self._comm_worker: CommWorker | None = None

    # -- the plan --------------------------------------------------------------------------
    def _make_plan(self) -> None:
        planned = per_layer_plan(self.model)
        self._plan = {id(layer): positions for layer, positions in planned}
        self._layers = [layer for layer, _ in planned]

    def plan(self) -> dict[int, list[int]]:
        """id(layer) -> positions (in ``trainable_variables``) of the variables gathered per layer."""
        if self._plan is None:
            self._make_plan()
        return self._plan

    def forget_plan(self) -> None:
        """The trainable variables changed (a new compile): plan again."""
        self.unhook()
        self._plan, self._layers, self._order = None, [], []

    def per_layer_positions(self) -> set[int]:
        """Positions whose storage is sharded (gathered per layer call)."""
        return {i for positions in self.plan().values() for i in positions}

    def whole_positions(self) -> list[int]:
        """Positions kept whole on every replica (level 2's treatment)."""
        per_layer = self.per_layer_positions()
        return [i for i in range(len(self.model.trainable_variables)) if i not in per_layer]

    # -- storage ---------------------------------------------------------------------------
    def release(self) -> None:
        """Drop the values of the per-layer variables this replica does not own."""
        owners = self.sharding.owners
        variables = self.model.trainable_variables
        for i in sorted(self.per_layer_positions()):
            v = variables[i]
            if owners[i] != self.sharding.rank and id(v) not in self._released:
                _internals.drop_value(v, ReleasedWeight(v.path, owners[i]))
                self._released[id(v)] = v
        self._sharded = True
        self.hook()

    def materialise_owned(self) -> None:
        """A model built in ``deferred_variables()``: give values (its initializers', as an
        eager build gives) to what this replica stores — the per-layer variables it owns and
        every variable kept whole — and release the others' per-layer variables from the
        start, so that no replica ever holds the whole model (not even during the build)."""
        owners = self.sharding.owners
        variables = self.model.trainable_variables
        for i in sorted(self.per_layer_positions()):
            v = variables[i]
            if owners[i] != self.sharding.rank and _deferred.is_deferred(v):
                _internals.drop_value(v, ReleasedWeight(v.path, owners[i]))
                self._released[id(v)] = v
        optimizer = getattr(self.model, "optimizer", None)
        for v in [*self.model.variables, *(optimizer.variables if optimizer is not None else [])]:
            if id(v) not in self._released and _deferred.is_deferred(v):
                _internals.initialize_deferred(v)
        self._sharded = True
        self.hook()

    def is_per_layer(self, variable) -> bool:
        """Whether ``variable`` is stored by its owner only (the same answer on every replica)."""
        variables = self.model.trainable_variables
        return any(variables[i] is variable for i in self.per_layer_positions())

    def is_released(self, variable) -> bool:
        return id(variable) in self._released

    def released(self) -> bool:
        """Whether the replicas store only what they own (the same answer on every replica)."""
        return self._sharded

    @contextlib.contextmanager
    def whole(self, gather: bool = True) -> Iterator[None]:
        """While inside, every variable holds its value on every replica (as at level 2):
        ``gather``: each released one from its owner (one broadcast per variable, in the
        model's order: a collective); else zeros (about to be overwritten, e.g. by loading a
        file). Released again after."""
        if not self._sharded:
            yield
            return
        owners = self.sharding.owners
        variables = self.model.trainable_variables
        comm = self.sharding.comm
        for i in sorted(self.per_layer_positions()):
            v = variables[i]
            shape = tuple(int(d) for d in v.shape)
            if id(v) in self._released:
                value = np.zeros(shape, np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype))
                if gather:
                    value = comm.broadcast(value.reshape(-1), owners[i]).reshape(shape)
                _internals.restore_value(v, value)
            elif gather and owners[i] == comm.rank:
                comm.broadcast(np.ascontiguousarray(np.asarray(v.numpy()).reshape(-1)), comm.rank)
        self._released.clear()
        self._sharded = False
        try:
            yield
        finally:
            self.release()

    # -- the layer hook ------------------------------------------------------------------------
    def hook(self) -> None:
        """Route each planned layer's call through :meth:`_call` (an instance attribute
        shadowing the class's ``call``; Keras' ``Operation.__call__`` calls ``self.call``)."""
        if self._hooked:
            return
        self.plan()
        for layer in self._layers:
            original = layer.call

            def call(*args, _layer=layer, _original=original, **kwargs):
                return self._call(_layer, _original, args, kwargs)

            object.__setattr__(layer, "call", call)
            self._hooked.append(layer)

    def unhook(self) -> None:
        for layer in self._hooked:
            layer.__dict__.pop("call", None)
        self._hooked = []

    @contextlib.contextmanager
    def step(self, has_data=None, backward: bool = True) -> Iterator[_StepState]:
        """While inside (a step's trace), planned layers gather their weights for each call."""
        state = _StepState(has_data)
        state.backward = backward
        self._state = state
        try:
            yield state
            self.settle(state)
        finally:
            self._state = None

    def current(self) -> _StepState | None:
        """The step being traced (inside :meth:`step`), else None."""
        return self._state

    # -- collectives (through the replica's CommWorker: _prefetch.py) ----------------------------
    def _worker(self) -> CommWorker:
        if self._comm_worker is None:
            self._comm_worker = CommWorker()
        return self._comm_worker

    def _layout(self, layer) -> _Layout:
        """How ``layer``'s weights travel: wire order by (owner, position), sizes, owned part."""
        owners = self.sharding.owners
        variables = self.model.trainable_variables
        order = sorted(self.plan()[id(layer)], key=lambda i: (owners[i], i))
        sizes = [int(np.prod(variables[i].shape)) for i in order]
        mine = [i for i in order if owners[i] == self.sharding.rank]
        counts = [sum(s for i, s in zip(order, sizes) if owners[i] == r) for r in range(self.sharding.size)]
        with _internals.without_autocast():  # the stored dtype (a variable reports the cast one)
            dtype = tf.as_dtype(variables[order[0]].dtype)
        return _Layout(order, sizes, mine, counts, dtype)

    def _owned_flat(self, lay: _Layout) -> tf.Tensor:
        """This replica's owned weights of a layer, read now, laid out flat."""
        variables = self.model.trainable_variables
        with _internals.without_autocast():  # the stored dtype (the call casts, as Keras does)
            owned = [tf.reshape(tf.convert_to_tensor(variables[i].value), [-1]) for i in lay.mine]
        return tf.concat(owned, 0) if len(owned) > 1 else owned[0] if owned else tf.zeros([0], lay.dtype)

    def _start(self, flat: tf.Tensor, state: _StepState, name: str = "tnt_shard3_allgather_start") -> tf.Tensor:
        """Hand the allgather of ``flat`` (each replica's owned part) to the worker; its key."""
        comm, worker = self.sharding.comm, self._worker()

        def start(a, _token):
            # A copy: TensorFlow may reuse the input's memory once this op returned.
            return np.int64(worker.submit(comm.allgather, np.array(a, copy=True))), np.int32(0)

        # The token is the op's own output (a constant would be folded away and the next
        # collective could overtake this one on one replica only).
        key, state.token = tf.numpy_function(start, [flat, state.token], [tf.int64, tf.int32], stateful=True,
                                             name=name)
        key.set_shape([])
        state.token.set_shape([])
        return key

    def _wait(self, key: tf.Tensor, lay: _Layout, state: _StepState, after: Sequence[tf.Tensor]) -> tf.Tensor:
        """The whole weights of the gather ``key`` started, waited for once ``after`` exist.

        ``after`` are data inputs (unread), not control dependencies: with control edges out
        of the layers' activations, level 3's predict read 2e-7 off level 2's (0 with data
        inputs), presumably as such an edge keeps Grappler from fusing MatMul, BiasAdd and
        the activation as it does at level 2."""
        worker = self._worker()

        def wait(k, _token, *_after):
            whole = worker.result(int(k))
            return whole, np.int32(whole.size)

        whole, state.token = tf.numpy_function(wait, [key, state.token, *after], [lay.dtype, tf.int32],
                                               stateful=True, name="tnt_shard3_allgather_wait")
        whole.set_shape([sum(lay.sizes)])
        state.token.set_shape([])
        return whole

    def _gathered(self, layer, state: _StepState, read) -> tuple[tf.Tensor, tf.Tensor]:
        """(key, owned read) of ``layer``'s gather: the one prefetched for it, else one started
        now from ``read()``. A prefetch of another layer (a wrong prediction) is waited for
        and dropped first: every started collective is waited for, in chain order."""
        pending, state.pending = state.pending, None
        if pending is not None and pending.layer is layer:
            return pending.key, pending.read
        if pending is not None:
            self._drop(pending, state)
        flat = read()
        return self._start(flat, state), flat

    def _drop(self, pending: Pending, state: _StepState) -> None:
        self._wait(pending.key, self._layout(pending.layer), state, ())

    def _prefetch(self, layer, call: int, flat: tf.Tensor, state: _StepState) -> tf.Tensor:
        """Start the gather of the next layer's weights (``flat``: this replica's part) now;
        its key, which the current layer's compute waits for, so that it runs meanwhile."""
        key = self._start(flat, state, name="tnt_shard3_allgather_prefetch")
        state.pending = Pending(layer, call, key, flat)
        return key

    def settle(self, state: _StepState) -> None:
        """End of a step's trace: wait for a prefetch no call used; remember the call order."""
        if state.pending is not None:
            pending, state.pending = state.pending, None
            self._drop(pending, state)
        if state.calls:
            self._order = list(state.calls)

    def _next_forward(self, call: int):
        """The layer predicted to be called after forward call ``call``: that of the last
        traced step's forward (the plan's order before the first)."""
        nxt = predict_next(self._order or self._layers, call, backward=False)
        return None if nxt is None else (self._order or self._layers)[nxt]

    def _scatter(self, flat: tf.Tensor, dtype: tf.DType, counts: list[int], own: int, keep, token):
        comm, worker = self.sharding.comm, self._worker()

        def scatter(buf, keep, _token):
            buf = np.ascontiguousarray(buf) if keep else np.zeros_like(buf)
            mine = worker.call(comm.reduce_scatter, buf, counts)  # after the prefetched gather
            return mine, np.int32(mine.size)

        mine, done = tf.numpy_function(scatter, [flat, keep, token], [dtype, tf.int32], stateful=True,
                                       name="tnt_shard3_reduce_scatter")
        mine.set_shape([own])
        done.set_shape([])
        return mine, done

    # -- one layer call ----------------------------------------------------------------------------
    def _call(self, layer, original, args, kwargs):
        state = self._state
        if state is None or _internals.in_symbolic_scope():
            return original(*args, **kwargs)  # shape inference, or outside tnt's steps (held weights)
        variables = self.model.trainable_variables
        lay = self._layout(layer)
        order, sizes, dtype, counts = lay.order, lay.sizes, lay.dtype, lay.counts
        call = len(state.calls)  # this call's number in the step's forward
        state.calls.append(layer)
        with _internals.without_autocast():
            held_values = [tf.convert_to_tensor(v.value) for v in layer.non_trainable_variables]
        held = list(layer.non_trainable_variables)
        flat_args, structure = _flatten_call(args, kwargs)
        inputs = _dense(flat_args)
        diff = [k for k, a in enumerate(flat_args) if _differentiable(a)]
        # Real reads of the owned variables, outside the custom gradient: the outer tape
        # differentiates through them, so an owner's gradient is the reduce-scattered sum.
        # This layer's gather was started by the previous call (prefetch) or starts here.
        key, flat_owned = self._gathered(layer, state, lambda: self._owned_flat(lay))
        nxt = self._next_forward(call)
        if nxt is not None:  # read once this layer's gather started (not held from the step's start)
            with tf.control_dependencies([key]):
                next_flat = self._owned_flat(self._layout(nxt))
        # The layer's __call__ entered its autocast scope (mixed precision: float16 compute of
        # float32 weights); backprop's recompute runs outside it and must cast alike.
        cast_to = _internals.autocast_dtype()

        def run(pieces, xs, training_tape=None):
            """The layer's call with the gathered weights and the forward's held state."""
            call_args = list(flat_args)
            for k, x in zip(diff, xs):
                call_args[k] = x
            a, kw = tf.nest.pack_sequence_as(structure, call_args)
            mapping = [(variables[i], p) for i, p in zip(order, pieces)] + list(zip(held, held_values))
            with _internals.autocast_to(cast_to), keras.StatelessScope(state_mapping=mapping) as scope:
                out = original(*a, **kw)
            return out, scope

        def split(whole, gate):
            """The layer's weights; computing with them waits for the next gather's start."""
            if gate is not None:
                with tf.control_dependencies([gate]):
                    whole = tf.identity(whole)
            parts = tf.split(whole, sizes) if len(sizes) > 1 else [whole]
            return [tf.reshape(p, variables[i].shape) for i, p in zip(order, parts)]

        updates: list = []
        shapes: list = []  # the call's output structure (its flat tensors cross the custom gradient)

        def forward_once(xs):
            """Wait for the gather (once the inputs exist), prefetch the next layer's, call,
            note the call's non-trainable updates; the flat outputs."""
            whole = self._wait(key, lay, state, inputs)
            gate = None if nxt is None else self._prefetch(nxt, call + 1, next_flat, state)
            out, scope = run(split(whole, gate), xs)
            for v, before in zip(held, held_values):
                after = scope.get_current_value(v)
                if after is not None and after is not before:
                    updates.append((v, after))
            shapes.append(out)
            return tf.nest.flatten(out)

        @tf.custom_gradient
        def forward(_flat, _anchor, *xs):
            flat_out = forward_once(xs)

            def grad(*dys, variables=None):
                dys = [tf.zeros_like(o) if d is None else d for d, o in zip(dys, flat_out)]
                # Gather again when backprop reaches this layer (not kept from the forward),
                # prefetched while the layer after it ran its backward. The owned weights are
                # read again (unchanged until the update after backprop) rather than kept: the
                # forward's concatenated copy of a layer whose variables this replica owns
                # several of stayed alive until here (2 x 64 MiB measured).
                def again():
                    with tf.control_dependencies(dys):
                        return tf.identity(self._owned_flat(lay))

                key2, _ = self._gathered(layer, state, again)
                whole2 = self._wait(key2, lay, state, _dense(dys))
                back = predict_next(state.calls, call, backward=True)  # backprop's next call
                gate = None
                if back is not None:
                    with tf.control_dependencies(dys):
                        nxt_flat = tf.identity(self._owned_flat(self._layout(state.calls[back])))
                    gate = self._prefetch(state.calls[back], back, nxt_flat, state)
                pieces = split(whole2, gate)
                with tf.GradientTape() as tape:
                    tape.watch(pieces)
                    tape.watch(list(xs))
                    out2, _ = run(pieces, xs)
                outs = tf.nest.flatten(out2)
                grads = tape.gradient(outs, [*pieces, *xs], output_gradients=dys,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
                dw, dx = grads[:len(pieces)], grads[len(pieces):]
                flat_dw = tf.concat([tf.reshape(tf.cast(g, dtype), [-1]) for g in dw], 0)
                mine_sum, state.token = self._scatter(flat_dw, dtype, counts, counts[self.sharding.rank],
                                                      state.has_data, state.token)
                # The owned sums leave with the token: the next collective waits for this one.
                with tf.control_dependencies([state.token]):
                    mine_sum = tf.identity(mine_sum)
                input_grads = [mine_sum, tf.zeros((), tf.float32), *dx]
                if variables:
                    return input_grads, [None] * len(variables)
                return input_grads

            return flat_out, grad

        if state.backward:
            flat_out = forward(flat_owned, state.anchor, *[flat_args[k] for k in diff])
        else:  # evaluate / predict: no backward pass to prepare for
            flat_out = forward_once([flat_args[k] for k in diff])
        for v, value in updates:  # batch norm's moving statistics, a seed's next state
            v.assign(value)
        return tf.nest.pack_sequence_as(shapes[0], list(flat_out))


def _flatten_call(args, kwargs):
    structure = (list(args), dict(kwargs))
    return tf.nest.flatten(structure), structure


def _dense(values) -> list[tf.Tensor]:
    """The dense tensors among ``values`` (an IndexedSlices by its values), to order an op after."""
    out = []
    for a in values:
        if isinstance(a, tf.IndexedSlices):
            a = a.values
        if isinstance(a, tf.Tensor):
            out.append(a)
    return out


def _differentiable(a) -> bool:
    return tf.is_tensor(a) and a.dtype.is_floating


def per_layer_plan(model: keras.Model) -> list[tuple[keras.layers.Layer, list[int]]]:
    """The leaf layers whose weights level 3 gathers around their call, each with the
    positions (in ``model.trainable_variables``) of those weights; every other trainable
    variable stays whole (module docstring). A pure function of the model, the same on
    every replica, so the planner (``tnt.plan_parallel``) counts what a replica will store."""
    variables = model.trainable_variables
    index = {id(v): i for i, v in enumerate(variables)}
    if has_sync_batch_norm(model):
        raise ShardingError(
            "tnt.Model(sharding=3) with synchronised batch normalisation: its collectives run "
            "inside the layers' calls, which level 3 recomputes in backprop. Use sharding=2, or "
            "sync_batch_norm=False.")
    claimed: dict[int, int] = {}
    candidates = []
    for layer in _internals.all_sublayers(model):
        own = [v for v in _internals.own_trainable_variables(layer) if id(v) in index]
        for v in own:
            claimed[id(v)] = claimed.get(id(v), 0) + 1
        if not own or isinstance(layer, (keras.Model, keras.layers.Embedding)):
            continue
        if any(s.trainable_weights for s in _internals.all_sublayers(layer)):
            continue  # a layer holding weighted sublayers: its own weights stay whole
        if any(getattr(v, "regularizer", None) is not None for v in own):
            continue  # Keras reads regularized weights outside the call (model.losses)
        if len({str(v.dtype) for v in own}) != 1:
            continue
        candidates.append((layer, own))
    return [(layer, sorted(index[id(v)] for v in own)) for layer, own in candidates
            if not any(claimed[id(v)] > 1 for v in own)]  # shared: may be read outside this call
