"""Run one stage's action list for one step: micro-batches in, gradients out.

Forward passes run under a ``tf.GradientTape`` around the stage's compiled forward
function, so the activations of micro-batch i stay alive (inside the tape) until B(i)
asks the tape for the gradients of the stage's outputs (given the received output
gradients) with respect to its boundary inputs and its weights. Under a schedule that
splits the backward (ZB-H1) the tape is persistent: B(i) asks it for the gradients with
respect to the boundary inputs only (sent upstream at once), W(i) later for those with
respect to the weights, and then lets it go. In TensorFlow each ``gradient`` call runs
the recorded forward's backward function, so B and W each cost about one joint backward
pass: the split buys a shorter critical path upstream at the price of extra compute
(docs/pipelining.md, "ZB-H1"). With ``remat="stages"`` (Note [Stage recomputation]) the
forward runs without a tape and keeps only its inputs; B re-runs it under a tape first.
Sends are non-blocking
and waited for at the end of the step; each receive is posted one message ahead of the
action that takes it (``ReceiveAhead``), so it lands while the stage computes.

Under the interleaved schedule a stage holds several chunks (``ChunkPasses`` each): every
action names its chunk, messages go to the stage holding the peer chunk (``peer % p``),
and a message between two chunks of this stage is handed over in the process. The
gradients of each chunk accumulate in micro-batch order; the step's gradients are the
chunks' lists joined in chunk order (the order of the stage model's variables).

Loss weighting (docs/architecture.md, "The mesh"): the last stage differentiates ``loss_i * b_i / B`` (B = the
global batch), every other stage adds its regularisation loss weighted alike, so summed
over the micro-batches of all replicas each counts exactly once. Both are scaled by the
optimizer's ``scale_loss`` (a ``LossScaleOptimizer``'s dynamic scale, a static
``loss_scale_factor``), as Keras' own train step scales its loss: weighting the loss, not
the gradients, keeps every backprop term at its serial magnitude, so float16 overflows
where serial Keras' step overflows (the micro-batches' float32 sum of a float16 gradient is
checked in float16: ``StageRuntime._finite_over_pipeline``). Weight gradients are
accumulated in micro-batch order, whatever order the schedule ran the backward passes in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from .._core import sparse as _sparse
from .._core import trace as _trace
from ._passes import TRAIN, ChunkPasses
from ._plan import Plan
from ._receive_ahead import Receive, ReceiveAhead, as_tensor
from ._remat import Recompute
from ._schedule import SPLIT_BACKWARD, num_chunks_per_stage, verify
from ._shapes import BoundaryShapes
from ._stages import StageModel
from ._transport import ACTIVATION, GRADIENT, Transport, message_tag


@dataclass
class StepResult:
    """What a stage produced in one step."""

    grads: list | None = None  # accumulated weighted gradients (train; tf.Variable if summed in place), None if no micro-batch
    predictions: list = field(default_factory=list)  # last stage, predict: one output per micro-batch
    peak_live: int = 0  # the most micro-batches in flight at once (forward done, backward not)
    peak_taped: int = 0  # of those, the most holding their activations (in a tape) at once
    seconds: float = 0.0  # wall time of the schedule
    window: tuple[float, float] = (0.0, 0.0)  # its start and end, time.time() (comparable across ranks of a host)
    busy_seconds: float = 0.0  # of which computing forward/backward passes (the rest is waiting)


def _taped(live: dict) -> int:
    """Micro-batches in ``live`` whose activations are held (not kept for recomputation)."""
    return sum(1 for r in live.values() if not isinstance(r, Recompute))


class _Accumulator:
    """One chunk's weight gradients summed in micro-batch order, whatever order they come in.

    The micro-batch next in order may sum its dense gradients in place, inside its W (Note
    [Gradients summed in place]): ``into(i)`` says where, and its gradients list then holds
    the sums' variables at those positions. The others are added here, one variable at a
    time, each micro-batch's tensor dropped once added."""

    def __init__(self) -> None:
        self.grads: list | None = None  # per variable: the sum so far (a tf.Variable if summed in place)
        self.pending: dict[int, list] = {}
        self.next = 0

    def into(self, i: int) -> list | None:
        """``sums`` for micro-batch ``i``'s backward (``ChunkPasses.backward_weights``):
        ``[]`` for the first, the sums so far for the next in order, else None."""
        if i != self.next:
            return None
        return [] if self.grads is None else self.grads

    def add(self, i: int, grads: list) -> None:
        self.pending[i] = grads
        while self.next in self.pending:
            g = self.pending.pop(self.next)
            # Sparse gradients: slices concatenated in micro-batch order, as serial
            # Keras' one lookup over the whole batch orders them (_sparse).
            if self.grads is None:
                self.grads = g
            else:
                for k in range(len(g)):
                    if g[k] is not self.grads[k]:  # not summed in place already
                        self.grads[k] = _add(self.grads[k], g[k])
                    g[k] = None
            del g
            self.next += 1

    def result(self) -> list:
        """The sums (a ``tf.Variable`` where summed in place: ``StageRuntime`` releases it
        variable by variable in the optimizer's update, Note [Gradients summed in place])."""
        out, self.grads = self.grads, None
        return out


def _add(total, grad):
    """``total + grad`` (``_sparse.accumulate``), into ``total`` if it is a variable."""
    if isinstance(total, tf.Variable):
        total.assign_add(tf.convert_to_tensor(grad))
        return total
    return _sparse.accumulate(total, grad)


class StageExecutor:
    """Executes the schedule of one stage of ``plan`` through ``transport``: ``stage`` is
    its one chunk's model, or (interleaved, ``virtual_stages`` v > 1) the list of its v
    chunks' models, in chunk order."""

    def __init__(self, stage: StageModel | list[StageModel], plan: Plan, transport: Transport, schedule: str,
                 remat: str | None = None, virtual_stages: int | None = None) -> None:
        chunks = list(stage) if isinstance(stage, list | tuple) else [stage]
        self.num_stages, self.virtual_stages = num_chunks_per_stage(plan, schedule, virtual_stages)
        self.stage = chunks[0]
        self.stage_index = chunks[0].index % self.num_stages  # this stage's pipeline position
        self.chunks = {st.index: ChunkPasses(st, plan, schedule, remat) for st in chunks}
        self.plan = plan
        self.transport = transport
        self.schedule = schedule
        self.step = 0
        self._shapes = BoundaryShapes(plan)  # dynamic axes: from each step's input shapes
        self._step_shapes: list[tuple] = []
        self._split = schedule in SPLIT_BACKWARD
        self._actions: dict[tuple[int, bool], list] = {}  # (micro-batches, training) -> verified list

    @property
    def no_gradient(self) -> frozenset[int] | None:
        """Positions, in the chunks' joined trainable variables, the loss does not reach
        (None until every chunk ran a backward pass)."""
        out, offset = set(), 0
        for passes in self.chunks.values():
            if passes.no_gradient is None:
                return None
            out.update(offset + k for k in passes.no_gradient)
            offset += len(passes.model.trainable_variables)
        return frozenset(out)

    @property
    def sums_in_place(self) -> bool:
        """Whether every chunk sums its dense weight gradients in place, inside W (Note
        [Gradients summed in place]); False where a backward could not be cut: its tape
        returns each micro-batch's whole gradient set beside the sum (the memory estimate
        counts that set)."""
        return all(p.sums_in_place for p in self.chunks.values())

    def regularization_value(self) -> float:
        """The weight-regularisation loss of this stage's chunks but the model's last (whose
        loss holds its own): what serial Keras adds to every step's loss."""
        return float(sum(p.regularization_value() for p in self.chunks.values() if not p.stage.is_last))

    def _rank(self, chunk: int) -> int:
        return chunk % self.num_stages

    # -- one step ------------------------------------------------------------------------------
    def run(self, mode: str, x_flat: list, y, sample_weight, sizes: list[int], total: int) -> StepResult:
        """Run the step's schedule over micro-batches of ``sizes`` (global batch ``total``)."""
        self.step += 1
        step = self.step
        plan, t = self.plan, self.transport
        me = self.stage_index
        training = mode == TRAIN
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        # Per (chunk, micro-batch): received inputs, outputs to send, output gradients,
        # input gradients, what the backward needs.
        received: dict[tuple, dict[int, tf.Tensor]] = {}
        outputs_np: dict[tuple, dict[int, np.ndarray]] = {}
        out_grads: dict[tuple, dict[int, tf.Tensor]] = {}
        in_grads: dict[tuple, list] = {}
        live: dict[tuple, tuple] = {}
        local: dict[tuple, object] = {}  # messages between two chunks of this stage
        sends = []
        result = StepResult()
        sums = {c: _Accumulator() for c in self.chunks}
        started, started_at = time.perf_counter(), time.time()

        # One split per input: along axis 0 TensorFlow hands out the rows without copying
        # (a slice per micro-batch copied each, ~1 ms per 4 MiB).
        data_inputs = sorted({j for p in self.chunks.values() for j in p.stage.data_inputs})
        data_parts = {j: tf.split(x_flat[j], sizes) for j in data_inputs}
        self._step_shapes = self._shapes.shapes([tuple(x.shape) for x in x_flat])
        todo = self._todo(len(sizes), training)
        rec = _trace.recorder()
        lane_args = {"stage": me, "step": step}

        def remote(a) -> bool:
            return self._rank(a.peer) != me

        inbox = ReceiveAhead(t, [self._receive(a, step, offsets) for a in todo
                                 if a.kind in ("RECV_ACT", "RECV_GRAD") and remote(a)])
        for a in todo:
            i = a.micro_batch
            c = a.chunk if a.chunk >= 0 else self.stage.index
            passes = self.chunks[c]
            st = passes.stage
            key = (c, i)
            chunk_args = {"chunk": c} if a.chunk >= 0 else {}
            lo, hi = offsets[i], offsets[i + 1]
            if a.kind == "RECV_ACT":
                t0 = time.perf_counter()
                value = inbox.next() if remote(a) else local.pop(("act", i, a.boundary, a.peer, c))
                received.setdefault(key, {})[a.boundary] = value
                if rec:
                    rec.add("recv act", "recv", "comm", t0, time.perf_counter(), peer=self._rank(a.peer), mb=i,
                            **chunk_args, **lane_args)
            elif a.kind == "F":
                inputs = [data_parts[j][i] for j in st.data_inputs]
                inputs += [received[key].pop(b) for b in st.inputs]
                received.pop(key, None)
                t0 = time.perf_counter()
                record, sent, prediction = passes.forward(mode, inputs, y, sample_weight, lo, hi, total)
                live[key] = record
                if sent is not None:
                    outputs_np[key] = sent
                if prediction is not None:
                    result.predictions.append(prediction)
                t1 = time.perf_counter()
                result.busy_seconds += t1 - t0
                if rec:
                    rec.add(f"F{i}", "forward", "compute", t0, t1, mb=i, **chunk_args, **lane_args)
                result.peak_live = max(result.peak_live, len(live))
                result.peak_taped = max(result.peak_taped, _taped(live))
                if not training:
                    live.pop(key)
            elif a.kind == "SEND_ACT":
                t0 = time.perf_counter()
                value = outputs_np[key][a.boundary]
                if remote(a):
                    sends.append(t.isend(value, self._rank(a.peer), (step, i, message_tag(a.boundary, ACTIVATION))))
                else:
                    local[("act", i, a.boundary, c, a.peer)] = as_tensor(value)
                if rec:
                    rec.add("send act", "send", "comm", t0, time.perf_counter(), peer=self._rank(a.peer), mb=i,
                            bytes=int(value.nbytes), **chunk_args, **lane_args)
            elif a.kind == "RECV_GRAD":
                t0 = time.perf_counter()
                arr = inbox.next() if remote(a) else local.pop(("grad", i, a.boundary, a.peer, c))
                if rec:
                    rec.add("recv grad", "recv", "comm", t0, time.perf_counter(), peer=self._rank(a.peer), mb=i,
                            **chunk_args, **lane_args)
                got = out_grads.setdefault(key, {})
                got[a.boundary] = arr if a.boundary not in got else got[a.boundary] + arr
            elif a.kind == "B":
                outputs_np.pop(key, None)
                sends = [r for r in sends if not r.test()]  # completed sends let go of their arrays
                variables = passes.model.trainable_variables
                t0 = time.perf_counter()
                if self._split:  # B: input gradients only; W(i) takes the weights' later
                    record = live[key] = passes.recomputed(live[key])
                    result.peak_taped = max(result.peak_taped, _taped(live))
                    d_inputs = passes.backward_inputs(record, out_grads.pop(key, {}))
                else:
                    record = passes.recomputed(live.pop(key))
                    result.peak_taped = max(result.peak_taped, _taped(live) + 1)
                    d_inputs, grads = passes.backward(record, out_grads.pop(key, {}), variables, sums[c].into(i))
                    del record
                    sums[c].add(i, grads)
                d_inputs = [np.asarray(d) for d in d_inputs]
                t1 = time.perf_counter()
                result.busy_seconds += t1 - t0
                if rec:
                    rec.add(f"B{i}", "backward", "compute", t0, t1, mb=i, **chunk_args, **lane_args)
                in_grads[key] = d_inputs
            elif a.kind == "W":
                t0 = time.perf_counter()
                sums[c].add(i, passes.backward_weights(live.pop(key), passes.model.trainable_variables,
                                                       sums[c].into(i)))
                t1 = time.perf_counter()
                result.busy_seconds += t1 - t0
                if rec:
                    extra = {"recomputes_backward": passes.split_fallback} if passes.split_fallback else {}
                    rec.add(f"W{i}", "weight", "compute", t0, t1, mb=i, **chunk_args, **lane_args, **extra)
            elif a.kind == "SEND_GRAD":
                differentiable = [b for b in st.inputs if plan.boundaries[b].differentiable]
                k = differentiable.index(a.boundary)
                t0 = time.perf_counter()
                value = np.asarray(in_grads[key][k])
                if remote(a):
                    sends.append(t.isend(value, self._rank(a.peer), (step, i, message_tag(a.boundary, GRADIENT))))
                else:
                    local[("grad", i, a.boundary, c, a.peer)] = as_tensor(value)
                if rec:
                    rec.add("send grad", "send", "comm", t0, time.perf_counter(), peer=self._rank(a.peer), mb=i,
                            **chunk_args, **lane_args)
                if k == len(differentiable) - 1:
                    in_grads.pop(key, None)
        t0 = time.perf_counter()
        for request in sends:
            request.wait()
        if rec and sends:
            rec.add("send wait", "send", "comm", t0, time.perf_counter(), **lane_args)
        if any(s.grads is not None for s in sums.values()):
            result.grads = [g for c in sorted(sums) for g in sums[c].result()]
        result.seconds = time.perf_counter() - started
        result.window = (started_at, started_at + result.seconds)
        return result

    def _todo(self, num_micro_batches: int, training: bool) -> list:
        """This stage's action list, the whole pipeline's checked once per shape (``verify``)."""
        key = (num_micro_batches, training)
        if key not in self._actions:
            lists = verify(self.plan, self.schedule, num_micro_batches, training, self.virtual_stages)
            self._actions[key] = lists[self.stage_index]
        return self._actions[key]

    def _receive(self, a, step: int, offsets: list[int]) -> Receive:
        """The message a RECV_ACT or RECV_GRAD action expects."""
        bd = self.plan.boundaries[a.boundary]
        kind = ACTIVATION if a.kind == "RECV_ACT" else GRADIENT
        rows = offsets[a.micro_batch + 1] - offsets[a.micro_batch]
        return Receive(self._rank(a.peer), (step, a.micro_batch, message_tag(a.boundary, kind)), bd.dtype,
                       (rows, *self._step_shapes[a.boundary]))
