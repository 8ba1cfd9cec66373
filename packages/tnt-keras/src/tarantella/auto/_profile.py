"""The measured per-layer profile the planner's cost model reads.

For each layer of the model (nested functional models opened): its weight bytes, its
output (activation) bytes per sample, and its forward + backward time at the micro-batch
sizes the search considers, fitted to ``a + b * rows``. A layer is timed on its own, with
random inputs of its input's shape and a ``tf.function`` computing the gradients of its
outputs' sum with respect to its weights and inputs, so profiling materialises one layer
at a time, called as its model calls it. A layer that cannot be timed alone (deferred
weights, several calls, no symbolic input) gets a FLOP-proxy time, and the profile says which
layers did.
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import time
from dataclasses import dataclass, field, replace

import keras
import numpy as np

from .._core.deferred import is_deferred
from . import _budget

#: Floating point operations per second assumed for a layer that could not be timed.
PROXY_FLOPS = 5e9
_REPEATS = 3
#: Calls timed for the fixed cost (cheap, and taken off every layer: its noise counts often).
_OVERHEAD_REPEATS = 15


@dataclass(frozen=True)
class LayerCost:
    """One layer: bytes and the fitted time of forward + backward for ``rows`` samples."""

    name: str
    weight_bytes: int
    trainable_bytes: int
    activation_bytes_per_sample: int
    a_s: float  # time at zero rows (launch overheads)
    b_s: float  # time per row
    measured: bool
    trainable_variables: int = 0  # how many (each costs the optimizer's update a launch)

    def time_s(self, rows: float) -> float:
        """Forward + backward seconds for ``rows`` samples."""
        return self.a_s + self.b_s * rows


@dataclass
class Profile:
    """Every layer's costs, in the model's order, and what was measured how."""

    model_name: str
    layers: list[LayerCost]
    rows_measured: tuple[int, ...]
    notes: list[str] = field(default_factory=list)
    #: The optimizer update's cost (Note [The update's time]): per variable and per byte.
    update_s_per_variable: float = 0.0
    update_s_per_byte: float = 0.0
    #: A timed call's own fixed cost (Note [Layers timed as their model calls them]): the
    #: layers' times are net of it; charged itself only where a step's own cost was not measured.
    call_s: float = 0.0
    #: A Keras training step's own cost (Note [A step's own cost], ``_step_overhead``),
    #: charged once per step of a layout without stages; 0: not measured (``call_s`` then).
    step_s: float = 0.0
    #: The pipeline executor's own seconds per step and per micro-batch on a stage (its
    #: Note [The pipeline's own cost]); 0: not measured (two calls per micro-batch counted).
    pipeline_step_s: float = 0.0
    pipeline_micro_batch_s: float = 0.0
    pipeline_variable_s: float = 0.0  # per trainable variable and step, its update included
    #: The length the model's open dimensions (None beyond the batch) were taken at, if given.
    sequence_length: int | None = None
    #: A step's compute slowed by the ranks computing at once on this host (Note [Ranks
    #: that share a host's cores]): 1 where one rank has the host, or not measured.
    contention: float = 1.0
    ranks_on_host: int = 1

    def step_overhead_s(self) -> float:
        """Seconds a step of a layout without stages spends beyond its layers and update."""
        return self.step_s if self.step_s > 0 else self.call_s

    def pipeline_overheads(self) -> tuple[float, float]:
        """(per step, per micro-batch) seconds a pipeline stage spends beyond its layers."""
        if self.pipeline_micro_batch_s > 0:
            return self.pipeline_step_s, self.pipeline_micro_batch_s
        return 0.0, 2 * self.call_s

    def pipeline_update_s(self, names, fraction: dict[str, float] | None = None, share: float = 1.0) -> float:
        """A pipeline stage's per-step cost of its layers ``names``' variables: their update
        (``update_s``) where the executor's per-variable cost was not measured, else that cost,
        which includes the update's launches, plus the update's bytes."""
        if self.pipeline_variable_s <= 0:
            return self.update_s(names, fraction, share)
        count, nbytes = self._variables_and_bytes(names, fraction)
        return count * self.pipeline_variable_s + share * nbytes * self.update_s_per_byte

    def update_s(self, names=None, fraction: dict[str, float] | None = None, share: float = 1.0) -> float:
        """Seconds of one optimizer update of the layers ``names`` (all: None), each layer's
        bytes times its ``fraction`` (a tensor split), ``share`` of them updated here (1/d
        where the replicas shard the update)."""
        count, nbytes = self._variables_and_bytes(names, fraction)
        return share * (count * self.update_s_per_variable + nbytes * self.update_s_per_byte)

    def _variables_and_bytes(self, names, fraction: dict[str, float] | None) -> tuple[int, float]:
        """Trainable variables and bytes (each layer's times its ``fraction``) of ``names`` (all: None)."""
        keep = None if names is None else set(names)
        fraction = fraction or {}
        layers = [c for c in self.layers if keep is None or c.name in keep]
        return (sum(c.trainable_variables for c in layers),
                sum(c.trainable_bytes * fraction.get(c.name, 1.0) for c in layers))

    def by_name(self) -> dict[str, LayerCost]:
        """{layer name: its costs}."""
        return {c.name: c for c in self.layers}

    def weight_bytes(self) -> int:
        """Bytes of every weight of the model."""
        return sum(c.weight_bytes for c in self.layers)

    def trainable_bytes(self) -> int:
        """Bytes of the trainable weights (the gradients' size)."""
        return sum(c.trainable_bytes for c in self.layers)

    def activation_bytes_per_sample(self, names=None) -> int:
        """Output bytes per sample of the layers ``names`` (all: None)."""
        keep = None if names is None else set(names)
        return sum(c.activation_bytes_per_sample for c in self.layers if keep is None or c.name in keep)

    def time_s(self, rows: float, names=None, scale: dict[str, float] | None = None) -> float:
        """Forward + backward of the layers ``names`` (all: None) for ``rows`` samples;
        ``scale`` multiplies some layers' time (a tensor-split layer: 1/t)."""
        keep = None if names is None else set(names)
        scale = scale or {}
        return sum(c.time_s(rows) * scale.get(c.name, 1.0) for c in self.layers
                   if keep is None or c.name in keep)


def _layers(model) -> list:
    out = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        if isinstance(layer, keras.Model) and getattr(layer, "_is_graph_network", False) is not False \
                and hasattr(layer, "layers") and layer.layers:
            out.extend(_layers(layer))
        else:
            out.append(layer)
    return out


def _nbytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in variables)


def _symbolic(tensors):
    return list(tensors) if isinstance(tensors, list | tuple) else [tensors]


def _sample_shape(symbolic, open_size: int | None) -> tuple[int, ...] | None:
    """A symbolic tensor's shape beyond the batch, each open (None) dimension taken at
    ``open_size``; None when one is open and no size is given."""
    shape = tuple(symbolic.shape)[1:]
    if any(d is None for d in shape):
        if open_size is None:
            return None
        shape = tuple(open_size if d is None else d for d in shape)
    return shape


def _has_open_dims(layer) -> bool:
    """Whether an input or output of ``layer`` leaves a dimension beyond the batch open."""
    arguments = _node_arguments(layer)
    tensors = list(arguments.keras_tensors) if arguments is not None else []
    try:
        tensors += _symbolic(layer.output)
    except (AttributeError, ValueError):
        pass
    return any(d is None for x in tensors for d in tuple(x.shape)[1:])


def _output_bytes(layer, open_size: int | None = None) -> int:
    try:
        outs = _symbolic(layer.output)
    except (AttributeError, ValueError):
        return 0
    total = 0
    for o in outs:
        shape = _sample_shape(o, open_size)
        if shape is None:
            return 0
        total += int(np.prod(shape)) * np.dtype(o.dtype).itemsize
    return total


def _twin_key(layer, open_size: int | None) -> str | None:
    """What makes two layers cost the same (Note [Identical layers timed once]): their
    class, config but the name, and the call's arguments (tensors by shape and dtype, the rest
    as written); None where unknown (the layer is timed on its own)."""
    arguments = _node_arguments(layer)
    if arguments is None:
        return None
    try:
        config = {k: v for k, v in layer.get_config().items() if k != "name"}
    except Exception:  # a layer without a config is timed on its own
        return None

    def describe(a):
        if isinstance(a, keras.KerasTensor):
            return ["tensor", _sample_shape(a, open_size), str(a.dtype)]
        return repr(a)

    args, kwargs = arguments.convert(describe)
    try:
        return json.dumps([type(layer).__module__, type(layer).__qualname__, config, args, kwargs],
                          sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return None


# Note [Identical layers timed once]
# A Transformer repeats one block N times, an MLP one Dense: layers of the same class and
# configuration called on tensors of the same shapes cost the same, so the first is timed and
# the rest take its figures (weights and activations are still read per layer). Timing is
# dominated by tracing each layer's gradient function (two traces per layer, one per size):
# a 100-block MLP planned for 8 ranks took 22 s with every layer timed and 7.9 s with this
# (the planner is held to 10 s; row auto_plan_seconds_100_blocks_8ranks).


def _node_arguments(layer):
    """The arguments of ``layer``'s one call in its model (keras' symbolic arguments: the
    positional and keyword ones, with KerasTensors where tensors flow), or None."""
    nodes = getattr(layer, "_inbound_nodes", [])
    if len(nodes) != 1:
        return None
    return getattr(nodes[0], "arguments", None)


def _timer(layer, open_size: int | None = None):
    """A function timing forward + backward of ``layer`` for ``rows`` samples, or None;
    ``open_size``: the length of every open (None) dimension beyond the batch.

    The layer is called as its model calls it (Note [Layers timed as their model calls them])."""
    import tensorflow as tf

    if any(is_deferred(v) for v in layer.weights):
        return None
    arguments = _node_arguments(layer)
    if arguments is None or not arguments.keras_tensors:
        return None
    inputs = list({id(x): x for x in arguments.keras_tensors}.values())  # one tensor per symbolic one
    shapes = [_sample_shape(x, open_size) for x in inputs]
    if any(shape is None for shape in shapes):
        return None
    position = {id(x): i for i, x in enumerate(inputs)}

    def step(xs):
        with tf.GradientTape() as tape:
            floats = [x for x in xs if x.dtype.is_floating]
            tape.watch(floats)
            args, kwargs = arguments.convert(
                lambda a: xs[position[id(a)]] if isinstance(a, keras.KerasTensor) else a)
            kwargs.setdefault("training", True)  # keras passes it on only where call takes it
            y = layer(*args, **kwargs)
            loss = _sum_of_outputs(y)
        return _values(tape.gradient(loss, list(layer.trainable_variables) + floats))

    compiled = _compiled(step, inputs, shapes)

    def run(rows: int) -> float:
        xs = _generated(inputs, shapes, rows)
        return _median_call_s(lambda: compiled(xs))

    return run


def _compiled(step, symbolic: list, shapes: list[tuple[int, ...]]):
    """``step`` as a TensorFlow function traced once for every row count (the batch dimension
    open), without AutoGraph (Keras 3 layers need none); tracing was most of a profile's time:
    MobileNetV3Small's 114 distinct layers 13 s with two traces each, 7.3 s so. A step that
    fails so (a layer reading its static batch size) is traced once per row count, each
    trace with static shapes."""
    import tensorflow as tf

    signature = [tf.TensorSpec((None, *shape), x.dtype) for x, shape in zip(symbolic, shapes)]
    fast = tf.function(step, input_signature=[signature], autograph=False)
    current = [fast]

    def call(xs):
        try:
            return current[0](xs)
        except Exception:
            if current[0] is not fast:
                raise
            current[0] = tf.function(step)  # a trace per row count, each with its static shapes
            return current[0](xs)

    return call


def _generated(symbolic: list, shapes: list[tuple[int, ...]], rows: int) -> list:
    """One tensor of ``rows`` samples per symbolic input: zeros where integer or boolean,
    else normal values."""
    import tensorflow as tf

    xs = []
    for x, sample in zip(symbolic, shapes):
        shape = (rows, *sample)
        dtype = np.dtype(x.dtype)
        # stateless: a seeded op also runs under op determinism (TF_DETERMINISTIC_OPS=1), where
        # tf.random.normal without a seed raises and every layer fell back to the FLOP proxy
        xs.append(tf.zeros(shape, dtype) if dtype.kind in "iub"
                  else tf.random.stateless_normal(shape, seed=(0, 0), dtype=x.dtype))
    return xs


def _sum_of_outputs(y):
    import tensorflow as tf

    return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(y)])


def _values(grads) -> list:
    """The gradients a step computed (an Embedding's IndexedSlices: its values), Nones left out."""
    import tensorflow as tf

    return [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]


def _whole_timer(model, open_size: int | None = None):
    """A function timing forward + backward of the whole ``model`` for ``rows`` samples (its
    outputs' sum differentiated with respect to its trainable weights), or None where its
    inputs are not known (a subclassed model) or a weight is deferred."""
    import tensorflow as tf

    if any(is_deferred(v) for v in model.weights):
        return None
    try:
        structure = model.input
    except (AttributeError, ValueError):
        return None
    flat = keras.tree.flatten(structure)
    if not flat or not all(isinstance(x, keras.KerasTensor) for x in flat):
        return None
    shapes = [_sample_shape(x, open_size) for x in flat]
    if any(shape is None for shape in shapes):
        return None

    def step(xs):
        with tf.GradientTape() as tape:
            y = model(keras.tree.pack_sequence_as(structure, xs), training=True)
            loss = _sum_of_outputs(y)
        return _values(tape.gradient(loss, model.trainable_variables))

    compiled = _compiled(step, flat, shapes)

    def run(rows: int, callers: int = 1) -> float:
        xs = _generated(flat, shapes, rows)
        if callers == 1:
            return _median_call_s(lambda: compiled(xs))
        return _concurrent_call_s(lambda: compiled(xs), callers)

    return run


def _concurrent_call_s(call, callers: int, repeats: int = _REPEATS) -> float:
    """Median seconds of ``call()`` while ``callers`` threads call it at once (TensorFlow
    runs a traced call without the GIL, on the process' shared thread pools), mean over them."""
    import threading

    call()
    medians: list[float] = []
    errors: list[BaseException] = []
    start = threading.Barrier(callers)

    def loop() -> None:
        try:
            start.wait()
            medians.append(_median_call_s(call, repeats))
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=loop) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return statistics.mean(medians)


def _median_call_s(call, repeats: int = _REPEATS) -> float:
    """Median seconds of ``call()`` (after one warm-up / trace), its outputs fetched."""
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for g in call():
            g.numpy()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# Note [Layers timed as their model calls them]
# A layer is called with the arguments of its node in the model (positional and keyword, the
# same symbolic tensor given twice as one generated tensor: MultiHeadAttention(h, h), keras-hub
# blocks with their masks), so attention is timed, not priced by its weights' FLOPs (it was:
# a small Transformer's pipeline stages ran 2.3x their predicted compute). Each timed call also
# pays the timing function's own fixed cost (calling a tf.function, fetching its outputs:
# 0.3-0.6 ms on a 2-core machine, as much as a small layer's whole work), which a training step
# pays once, not once per layer: it is measured on an empty gradient (``_call_overhead_s``),
# taken off each layer's time at zero rows. What a step pays instead is measured on whole
# steps: Keras' (Note [A step's own cost], ``_step_overhead``) and a pipeline stage's
# (Note [The pipeline's own cost], ``_pipeline_overhead``).


@functools.cache
def _call_overhead_s() -> float:
    """Seconds of one timing call that computes nothing: a gradient of one element's sum."""
    import tensorflow as tf

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(x)
        return [tape.gradient(loss, x)]

    x = tf.zeros((1, 1), tf.float32)
    return _median_call_s(lambda: step(x), _OVERHEAD_REPEATS)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    if len(points) == 1 or points[0][0] == points[-1][0]:
        r, t = points[0]
        return 0.0, t / max(r, 1)
    (r0, t0), (r1, t1) = points[0], points[-1]
    b = max((t1 - t0) / (r1 - r0), 0.0)
    return max(t0 - b * r0, 0.0), b


def profile(model: keras.Model, rows: list[int] | tuple[int, ...], sequence_length: int | None = None,
            ranks_on_host: int = 1) -> Profile:
    """Measure ``model``'s layers at the smallest and largest of ``rows`` (samples);
    ``sequence_length``: the length of every dimension the model leaves open beyond the
    batch (a Transformer's sequence), without which such layers get the FLOP proxy and no
    activation bytes. ``ranks_on_host``: the ranks that will compute at once on this host
    (Note [Ranks that share a host's cores]). The model's state is left as it was (Note
    [Profiling leaves the model as it was])."""
    with _state_kept(model):
        return _profile(model, rows, sequence_length, ranks_on_host)


# Note [Profiling leaves the model as it was]
# Layers are timed in training mode, so a BatchNormalization's moving statistics move with
# every timed call (on random inputs) and a random layer's seed state may advance. The
# planner runs on the user's model before it trains (in a job: rank 0's, whose weights the
# replicas then take), so without this the trained model's moving statistics differed from
# serial Keras' after AUTO planned. Every non-trainable variable is copied before the
# profile and written back after it; trainable weights are only read.
@contextlib.contextmanager
def _state_kept(model):
    kept = [(v, np.array(v.numpy(), copy=True)) for v in model.non_trainable_variables if not is_deferred(v)]
    try:
        yield
    finally:
        for v, value in kept:
            v.assign(value)


def _profile(model: keras.Model, rows, sequence_length: int | None, ranks_on_host: int) -> Profile:
    sizes = sorted({int(r) for r in rows if int(r) > 0}) or [1]
    sizes = [sizes[0], sizes[-1]] if len(sizes) > 1 else sizes
    costs, proxied, open_ = [], [], []
    timed: dict[str, tuple[float, float]] = {}  # a timed layer's figures by _twin_key
    shared = 0
    overhead = _call_overhead_s()
    for layer in _layers(model):
        wb, tb = _nbytes(layer.weights), _nbytes(layer.trainable_weights)
        if sequence_length is None and _has_open_dims(layer):
            open_.append(layer.name)
        act = _output_bytes(layer, sequence_length)
        twin = _twin_key(layer, sequence_length)
        if twin in timed:  # Note [Identical layers timed once]
            costs.append(LayerCost(layer.name, wb, tb, act, *timed[twin], True, len(layer.trainable_weights)))
            shared += 1
            continue
        run = _timer(layer, sequence_length)
        points = []
        if run is not None:
            try:
                points = [(r, run(r)) for r in sizes]
            except Exception:  # a layer that cannot run alone gets the proxy
                points = []
        if points:
            a, b = _fit(points)
            a = max(a - overhead, 0.0)  # Note [Layers timed as their model calls them]
            measured = True
            if twin is not None:
                timed[twin] = (a, b)
        else:  # forward 2 FLOPs per weight per row, backward twice that
            a, b = 0.0, 6.0 * max(wb // 4, 1) / PROXY_FLOPS
            measured = False
            proxied.append(layer.name)
        costs.append(LayerCost(layer.name, wb, tb, act, a, b, measured, len(layer.trainable_weights)))
    costs, scaled, contention = _scaled_to_whole(model, costs, sizes, sequence_length, overhead, ranks_on_host)
    notes = [scaled] if scaled else []
    if open_:
        notes.append(f"{len(open_)} layer(s) leave a dimension beyond the batch open (None): "
                     + ", ".join(open_[:8]) + (" ..." if len(open_) > 8 else "")
                     + "; pass sequence_length= (the length the model trains at) to time them and count "
                       "their activations")
    if shared:
        notes.append(f"{shared} layer(s) priced as an identical layer timed before them (same class, config and "
                     "input shapes)")
    if proxied:
        notes.append(f"{len(proxied)} layer(s) not timed alone, FLOP proxy at {PROXY_FLOPS:.0e} FLOP/s: "
                     + ", ".join(proxied[:8]) + (" ..." if len(proxied) > 8 else ""))
    per_variable, per_byte = _update_cost()
    from . import _pipeline_overhead, _step_overhead

    return Profile(model.name, costs, tuple(sizes), notes, per_variable, per_byte, overhead,
                   _step_overhead.measure(per_variable), *_pipeline_overhead.measure(), sequence_length,
                   contention, ranks_on_host)


# Note [Layers scaled to the whole model]
# A layer timed alone does more than its share of the model's step: it differentiates its
# outputs' own sum (a reduction and a fill per layer), computes the gradient of its inputs
# even where the model's first layer needs none, and its outputs are fetched. Summed over the
# layers this over-counted the whole model's forward + backward 1.3-2.4x here (a CNN 11.6 vs
# 8.5 ms at 8 rows, 24.0 vs 16.9 at 32; an MLP 2.6 vs 1.1 ms), while the whole model's
# forward + backward plus the update and a step's own cost matched serial Keras' measured
# step. So the whole model is timed too, as its layers are (net of a call's fixed cost, at the
# same row counts), and the timed layers' intercepts and per-row times are scaled so that
# their sum is the whole model's (each factor kept within 1/4 and 4 against a noisy fit).
# The layers' proportions, which the stage partition and the tensor split read, stay as
# measured. A model whose inputs are not known (subclassed) or whose whole pass fails keeps
# the layers' own times; the profile's notes say which.
_SCALE_LIMITS = (0.25, 4.0)


def _scaled_to_whole(model, costs: list[LayerCost], sizes: list[int], open_size: int | None,
                     overhead: float, ranks_on_host: int = 1) -> tuple[list[LayerCost], str | None, float]:
    """``costs`` with the timed layers scaled to the whole model's forward + backward
    (Note [Layers scaled to the whole model]), a note saying by how much (or why not), and
    the slowdown of that pass when ``ranks_on_host`` ranks run it at once (Note [Ranks that
    share a host's cores]; 1.0 where not measured)."""
    timed = [c for c in costs if c.measured]
    if not timed:
        return costs, None, 1.0
    # the whole pass holds every gradient and (twice, forward and backward) every activation
    # at once, which timing one layer at a time never did: not where this rank's share of
    # memory could not hold it (a model AUTO is to spread because it does not fit one process)
    need = sum(c.trainable_bytes for c in costs) + 2 * sum(c.activation_bytes_per_sample for c in costs) * sizes[-1]
    share, _ = _budget.default_budget(1)
    if share is not None and need > share // 2:
        return (costs, f"layers' times not scaled to the whole model (its pass would hold about "
                f"{need / 2**20:.1f} MiB, over half of this rank's {share / 2**20:.1f} MiB)", 1.0)
    unmeasured = ""
    if share is not None and ranks_on_host > 1 and need * ranks_on_host > share // 2:
        unmeasured = f"; the host's cores not measured ({ranks_on_host} passes at once would not fit)"
        ranks_on_host = 1  # rather than this rank's memory exhausted
    run = _whole_timer(model, open_size)
    if run is None:
        return (costs, "layers' times not scaled to the whole model (its inputs are not known or a weight is "
                "deferred)", 1.0)
    try:
        seconds = [run(r) for r in sizes]
        contention = _contention(run, sizes[-1], ranks_on_host, alone=seconds[-1])
        points = [(r, max(t - overhead, 0.0)) for r, t in zip(sizes, seconds)]
    except Exception as exc:  # the layers' own times rather than no plan
        return (costs, f"layers' times not scaled to the whole model (its forward + backward failed: "
                f"{type(exc).__name__})", 1.0)
    proxied = [c for c in costs if not c.measured]
    targets = [(r, t - sum(c.time_s(r) for c in proxied)) for r, t in points]
    a_sum, b_sum = sum(c.a_s for c in timed), sum(c.b_s for c in timed)
    lo, hi = _SCALE_LIMITS
    if len(targets) == 2:
        (r0, w0), (r1, w1) = targets
        b_whole = (w1 - w0) / (r1 - r0)
        a_whole = w0 - b_whole * r0
        fa = a_whole / a_sum if a_sum > 0 else 1.0
        fb = b_whole / b_sum if b_sum > 0 else 1.0
    else:
        (r0, w0), = targets
        fa = fb = w0 / (a_sum + b_sum * r0) if a_sum + b_sum * r0 > 0 else 1.0
    fa, fb = min(max(fa, lo), hi), min(max(fb, lo), hi)
    scaled = [replace(c, a_s=c.a_s * fa, b_s=c.b_s * fb) if c.measured else c for c in costs]
    note = (f"layers' times scaled to the whole model's measured forward + backward: intercepts x{fa:.2f}, "
            f"per-row times x{fb:.2f}")
    if ranks_on_host > 1:
        note += (f"; {ranks_on_host} ranks computing at once on this host slow that pass x{contention:.2f} "
                 "(charged to the steps of layouts without stages)")
    return scaled, note + unmeasured, contention


# Note [Ranks that share a host's cores]
# Ranks on one host share its cores: on the 2-core machine two DATA ranks each ran their
# half batch 1.3-1.8x slower than one process alone (the profile's condition), and every
# layout without stages was predicted 28-32 % short (median) once the layers' sum was right.
# The planner already takes the ranks on this host for the memory budget (``_budget``); the
# same count of threads now run the whole model's compiled pass at once (TensorFlow runs a
# traced call without the GIL, on the process' shared thread pools, as processes share the
# cores), at the largest row count, and the ratio to one caller alone, kept within 1 and the
# number of ranks, multiplies a step's compute (layers, update, a step's own cost) in
# layouts without stages, where every rank computes through the same phases at once. A
# pipeline's stages take turns (each waits on its neighbour's boundary tensors) and were
# predicted within -7 to -13 % (median) without it, so their steps are not charged it.
# Measured here: CNN x1.32-1.38, MLP x1.26-1.42, Transformer x1.78-1.81. At most
# ``_MAX_CALLERS`` run at once (planning 64 ranks on a laptop stays quick), more taken as
# slowing it in proportion; on a GPU nothing is charged (each rank of a host has its own).
#: At most this many callers at once; beyond, the slowdown is taken to grow with the count.
_MAX_CALLERS = 8


def _contention(run, rows: int, ranks_on_host: int, alone: float) -> float:
    """The whole model's pass at ``rows`` with ``ranks_on_host`` callers at once against
    ``alone``, its seconds with one caller (1.0 on a GPU: each rank of a host has its own device)."""
    import tensorflow as tf

    if ranks_on_host <= 1 or tf.config.list_physical_devices("GPU"):
        return 1.0
    callers = min(ranks_on_host, _MAX_CALLERS)
    together = run(rows, callers=callers) * ranks_on_host / callers
    return min(max(together / alone, 1.0), float(ranks_on_host)) if alone > 0 else 1.0


# Note [The update's time]
# The layers' timings are forward + backward only; the optimizer's update of every variable a
# rank holds comes on top of them each step (measured on a quiet 16-core machine: a CNN's
# DATA step under-predicted by 19 % while a tensor group, which updates half the weights,
# was not). Its cost is taken from Adam (the layouts are planned before compile) on probe
# variables: per variable (the update's ops' launches: 16 one-element variables against
# one, so the call's own fixed cost, which a training step pays anyway, drops out) and per
# byte (one 4 MiB variable against one element), fitted as ``count * per_variable + bytes *
# per_byte``. Sharded replicas update 1/d of it; a tensor shard its fraction; a stage its
# own layers.
_PROBE_ELEMENTS = 1 << 20
_PROBE_SMALL = 16


@functools.cache
def _update_cost() -> tuple[float, float]:
    """(seconds per variable, seconds per byte) of an Adam update, measured on probes."""
    import tensorflow as tf

    def timed(shapes: list[int]) -> float:
        variables = [keras.Variable(np.zeros(n, np.float32)) for n in shapes]
        grads = [tf.ones(n, tf.float32) for n in shapes]
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(variables)

        @tf.function
        def step():
            optimizer.apply(grads, variables)

        step()  # trace / warm up
        times = []
        for _ in range(_REPEATS + 2):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    try:
        one = timed([1])
        small = timed([1] * _PROBE_SMALL)
        large = timed([_PROBE_ELEMENTS])
    except Exception:  # no update term rather than no plan
        return 0.0, 0.0
    per_variable = max(small - one, 0.0) / (_PROBE_SMALL - 1)
    return per_variable, max(large - one, 0.0) / (4 * (_PROBE_ELEMENTS - 1))
