"""ZB-H1's B and W cut out of TensorFlow's own backward function of a stage's forward.

Note [Split backward]
A stage's forward is a ``tf.function``. Under a tape, TensorFlow runs it as a forward
function that also returns the intermediates its backward needs, and records ONE op whose
backward function computes the gradients of all the function's inputs (captured variables
included). Two ``tape.gradient`` calls (inputs, then weights) would each run that whole
backward: W would cost a full backward pass.

Here the forward runs as TensorFlow's first-order forward function (the one 1F1B's tape
runs), and TensorFlow's backward function graph for it is cut in two:
- B: the ops the gradients of the watched inputs need (the chain through the activations),
  returning those gradients and every tensor of the chain a weight-gradient op reads
  (per layer, the gradient of its pre-activation);
- W: the other ops the weight gradients need (per Dense, ``x^T dy`` and the bias' column
  sum), fed with B's tensors and the forward's intermediates.
Every gradient is computed by the very ops of the joint backward from the very same
values, so weights stay bitwise those of 1F1B. A stage without watched inputs (the first)
has an empty B: its W is the whole backward, B + W the same work.

The cut uses TensorFlow internals (the forward/backward pair of a concrete function,
``lift_to_graph``); where they are missing or the graph cannot be cut (a control edge
across the cut, a collective among the weight-gradient ops), ``SplitUnavailable`` says
why and the stage falls back to the persistent tape (W then recomputes the backward):
``ChunkPasses.split_fallback`` holds the reason, a warning and the timeline's W events
(``recomputes_backward``) show it.

Note [Gradients summed in place]
Every schedule runs its forward through the cut (1F1B and GPipe run B and W back to back:
the joint backward's work, no more). W's dense weight gradients can then be summed into
the micro-batch sum inside W's own function: a variant of W (``backward_weights_into``)
writes (first micro-batch) or adds (the next ones, in micro-batch order) each gradient
into a variable as soon as it is computed, so TensorFlow's executor frees it at once and a
stage never holds a whole micro-batch's gradient set beside the sum. ``sum = g`` and then
``sum += g`` are the additions the executor made before (elementwise, in micro-batch
order), so results stay bitwise. Sparse gradients (slices concatenated) are returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

try:  # TensorFlow internals: the cut falls back to the tape without them
    from tensorflow.python.eager import backprop_util, lift_to_graph
    from tensorflow.python.eager.polymorphic_function import atomic_function, function_type_utils
    from tensorflow.python.framework import func_graph as func_graph_module
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import array_ops, default_gradient, gradients_util
    from tensorflow.python.ops.op_selector import UnliftableError
    from tensorflow.python.util import nest
    _INTERNALS_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - another TensorFlow
    _INTERNALS_ERROR = f"TensorFlow internals missing ({exc})"


class SplitUnavailable(Exception):
    """The backward of this forward cannot be cut into B and W (the message says why)."""


@dataclass
class _Cut:
    """B and W of one concrete function for given watched inputs."""

    forward: object  # TensorFlow's first-order forward function (outputs + intermediates)
    backward_inputs: list  # placeholders of the backward graph
    trainable_outputs: list[int]  # inference outputs that get a gradient placeholder
    capture_sources: list  # per backward capture: index into the forward's outputs, or a constant
    b_fn: object
    b_structure: list  # per watched input: its gradient's structure (None: unconnected)
    b_count: int  # flat outputs of B that are input gradients (the rest feed W)
    w_fn: object
    w_feeds: list[tuple[str, int]]  # ("in", backward input index) or ("b", B output index)
    w_structure: list  # per captured input position: gradient structure or None
    handle_positions: dict[int, int]  # id(captured variable handle) -> its flat input position
    num_inference_outputs: int
    pack_output: object
    w_dense: dict[int, int]  # input position -> index in W's flat outputs of its dense float gradient
    w_graph: object = None  # what W's in-place variants are lifted from: the backward graph,
    w_fetches: list | None = None  # W's outputs
    w_sources: list | None = None  # and W's inputs


@dataclass
class SplitRecord:
    """One micro-batch between its forward and its W."""

    cut: _Cut
    outputs: object  # the forward's structured outputs
    saved: list | None  # the forward's flat outputs (intermediates) until B
    watched: list  # the watched inputs (the shapes of their zero gradients)
    w_values: list | None = None  # W's inputs, kept from B until W

    def positions(self, variables) -> list[int | None]:
        """Per Keras variable: its flat input position in the forward (None: not read)."""
        handles = self.cut.handle_positions
        return [handles.get(id(getattr(getattr(v, "value", v), "handle", v))) for v in variables]


def _ancestors(tensors, stop) -> set:
    seen: set = set()
    todo = [t.op for t in tensors]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        if op in stop:
            continue
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return seen


def _flat(structure) -> list:
    return [] if structure is None else nest.flatten(structure, expand_composites=True)


def _pack(structures: list, flat: list) -> list:
    """``flat`` (the components of every non-None structure in turn) packed per structure."""
    out, k = [], 0
    for s in structures:
        n = len(_flat(s))
        out.append(None if s is None else nest.pack_sequence_as(s, flat[k: k + n], expand_composites=True))
        k += n
    return out


def _function(name: str, graph, fetches, sources):
    out = func_graph_module.FuncGraph(name)
    with out.as_default():
        op_map = lift_to_graph.lift_to_graph(fetches, out, sources=sources, base_graph=graph)
    out.inputs = [op_map[s] for s in sources]
    out.outputs = [op_map[t] for t in fetches]
    out.structured_outputs = list(out.outputs)
    return atomic_function.from_func_graph(name, out, {})


def _function_into(name: str, graph, fetches, sources, into: list[int], assign: bool):
    """``_function`` whose fetches at ``into`` are written (``assign``) or added into the
    variables whose handles follow ``sources`` as inputs, each as soon as it is computed
    (Note [Gradients summed in place]); returns the other fetches and a flag whose control
    inputs are the writes (so they run)."""
    out = func_graph_module.FuncGraph(name)
    with out.as_default():
        op_map = lift_to_graph.lift_to_graph(fetches, out, sources=sources, base_graph=graph)
        handles = [array_ops.placeholder(tf.resource, shape=[]) for _ in into]
        write = tf.raw_ops.AssignVariableOp if assign else tf.raw_ops.AssignAddVariableOp
        writes = [write(resource=h, value=op_map[fetches[k]]) for h, k in zip(handles, into)]
        flag = tf.constant(True)
        with tf.control_dependencies(writes):
            done = tf.identity(flag)
    skipped = set(into)
    out.inputs = [op_map[s] for s in sources] + handles
    out.outputs = [op_map[t] for k, t in enumerate(fetches) if k not in skipped] + [done]
    out.structured_outputs = list(out.outputs)
    return atomic_function.from_func_graph(name, out, {})


class SplitBackward:
    """Forward, B and W of a ``tf.function`` ``fn`` whose positions ``watched`` (of its flat
    inputs) get input gradients; cuts made once per concrete function."""

    def __init__(self) -> None:
        self._cuts: dict = {}
        self._into: dict = {}  # (id(cut), positions, assign) -> W writing/adding into variables

    def forward(self, fn, args: tuple, watched: list[int]) -> SplitRecord:
        """Run ``fn(*args)`` as TensorFlow's first-order forward function."""
        if _INTERNALS_ERROR:
            raise SplitUnavailable(_INTERNALS_ERROR)
        cf = fn.get_concrete_function(*args)
        flat = cf.function_type.unpack_inputs(function_type_utils.canonicalize_function_inputs(args, {}, cf.function_type))
        all_args = list(flat) + list(cf.captured_inputs)
        key = (id(cf), tuple(watched))
        held = self._cuts.get(key)
        if held is None or held[0] is not cf:  # the function held: its id stays its own
            try:
                held = self._cuts[key] = (cf, self._cut(cf, all_args, watched))
            except (AttributeError, TypeError, ValueError, LookupError, UnliftableError) as exc:  # another TensorFlow
                raise SplitUnavailable(f"TensorFlow's backward function could not be cut: {exc!r}") from exc
        cut = held[1]
        flat_outputs = cut.forward.call_flat(*all_args)
        return SplitRecord(cut, cut.pack_output(flat_outputs), list(flat_outputs), [all_args[i] for i in watched])

    def _cut(self, cf, all_args: list, watched: list[int]) -> _Cut:
        call = cf._select_forward_and_backward_functions(
            all_args, gradients_util.POSSIBLE_GRADIENT_TYPES_FIRST_ORDER, True)
        forward, _ = call.forward()
        functions = call._functions
        backward = functions._backward
        fgraph = functions._forward_graph
        n_inf = functions._num_inference_outputs
        bgraph = backward.graph
        out_index = {ops.tensor_id(t): i for i, t in enumerate(fgraph.outputs)}
        capture_sources = [out_index.get(ops.tensor_id(c), c) for c in backward.captured_inputs]
        n_grads = len(bgraph.inputs) - len(backward.captured_inputs)
        trainable = [i for i, t in enumerate(fgraph.outputs[:n_inf]) if backprop_util.IsTrainable(t)][:n_grads]
        if len(trainable) != n_grads:
            raise SplitUnavailable("the backward function takes gradients the forward's outputs do not match")
        structure = list(bgraph.structured_outputs)
        if len(structure) != len(all_args):
            raise SplitUnavailable("the backward function's outputs do not match the forward's inputs")
        var_positions = [i for i in range(len(all_args)) if i not in watched and structure[i] is not None]
        b_flat = [t for i in watched for t in _flat(structure[i])]
        w_flat = [t for i in var_positions for t in _flat(structure[i])]
        inputs = list(bgraph.inputs)
        stop = {t.op for t in inputs}
        in_b = _ancestors(b_flat, stop)
        w_only = _ancestors(w_flat, stop) - in_b - stop
        # W's inputs: what its ops read from outside W (B's tensors, the backward's inputs)
        # and the weight gradients B already computed
        cut_tensors, seen = [], set()
        consumers = [t for op in w_only for t in op.inputs if t.op not in w_only]
        consumers += [t for t in w_flat if t.op not in w_only]
        for t in consumers:
            if ops.tensor_id(t) not in seen:
                seen.add(ops.tensor_id(t))
                cut_tensors.append(t)
        for op in w_only:
            if any(c not in w_only for c in op.control_inputs):
                raise SplitUnavailable(f"a control edge crosses the cut at {op.name}")
            if "Collective" in op.type or "Nccl" in op.type:  # W would move a collective in time
                raise SplitUnavailable(f"the weight gradients run a collective ({op.name})")
        input_ids = {ops.tensor_id(t): k for k, t in enumerate(inputs)}
        from_b = [t for t in cut_tensors if ops.tensor_id(t) not in input_ids]
        b_ids = {ops.tensor_id(t): len(b_flat) + k for k, t in enumerate(from_b)}
        w_feeds = [("in", input_ids[ops.tensor_id(t)]) if ops.tensor_id(t) in input_ids
                   else ("b", b_ids[ops.tensor_id(t)]) for t in cut_tensors]
        name = bgraph.name
        b_fn = _function(f"{name}_zb_B", bgraph, b_flat + from_b, inputs) if b_flat + from_b else None
        w_fn = _function(f"{name}_zb_W", bgraph, w_flat, cut_tensors) if w_flat else None
        w_structure = [None] * len(all_args)
        for i in var_positions:
            w_structure[i] = structure[i]
        n_flat = len(all_args) - len(cf.captured_inputs)
        handles = {id(c): n_flat + k for k, c in enumerate(cf.captured_inputs) if c.dtype == tf.resource}
        w_dense, k = {}, 0
        for i in var_positions:
            n = len(_flat(structure[i]))
            if isinstance(structure[i], tf.Tensor) and structure[i].dtype.is_floating:
                w_dense[i] = k
            k += n
        return _Cut(forward, inputs, trainable, capture_sources, b_fn, [structure[i] for i in watched],
                    len(b_flat), w_fn, w_feeds, w_structure, handles, n_inf, cf.function_type.pack_output,
                    w_dense, bgraph, w_flat, cut_tensors)

    def backward_inputs(self, record: SplitRecord, output_gradients: list) -> list:
        """B: the watched inputs' gradients (None: unconnected) given the gradients of the
        forward's inference outputs (None: zero, as TensorFlow's tape passes them)."""
        cut = record.cut
        saved = record.saved
        grads = []
        for k in cut.trainable_outputs:
            g = output_gradients[k]
            if g is None:
                g = tf.zeros(tf.shape(saved[k]), default_gradient.shape_and_dtype(cut.backward_inputs[len(grads)])[1])
            elif isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            grads.append(g)
        captures = [saved[s] if isinstance(s, int) else s for s in cut.capture_sources]
        values = grads + captures
        b_out = cut.b_fn.call_flat(*values) if cut.b_fn is not None else []
        record.saved = None  # the intermediates only W reads stay in w_values
        record.w_values = [values[i] if kind == "in" else b_out[i] for kind, i in cut.w_feeds]
        return _pack(cut.b_structure, list(b_out[: cut.b_count]))

    def backward_weights(self, record: SplitRecord) -> list:
        """W: per flat input position of the forward, its gradient (None: not a variable or
        unconnected)."""
        cut = record.cut
        values, record.w_values = record.w_values, None
        flat = cut.w_fn.call_flat(*values) if cut.w_fn is not None else []
        return _pack(cut.w_structure, list(flat))

    def backward_weights_into(self, record: SplitRecord, sums: dict[int, object], assign: bool) -> list:
        """W writing (``assign``: the first micro-batch) or adding the gradients of the input
        positions ``sums`` (dense ones, ``cut.w_dense``) into the variables whose handles it
        maps them to (Note [Gradients summed in place]); per flat input position, the other
        gradients as ``backward_weights`` gives them (None at the positions of ``sums``)."""
        cut = record.cut
        positions = tuple(sorted(sums))
        if not positions:
            return self.backward_weights(record)
        key = (id(cut), positions, assign)
        held = self._into.get(key)
        if held is None or held[0] is not cut:
            into = [cut.w_dense[p] for p in positions]
            name = f"{cut.w_graph.name}_zb_W_{'set' if assign else 'add'}"
            held = self._into[key] = (cut, _function_into(name, cut.w_graph, cut.w_fetches, cut.w_sources,
                                                          into, assign))
        values, record.w_values = record.w_values, None
        flat = held[1].call_flat(*values, *[sums[p] for p in positions])
        structure = [None if i in sums else s for i, s in enumerate(cut.w_structure)]
        return _pack(structure, list(flat)[:-1])
