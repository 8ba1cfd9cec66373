"""Which layer runs on which pipeline stage, and which tensors cross between stages.

A plan comes from ``SplitLayer`` markers, from explicit split points (``split_after``:
layer names after which a new stage starts, in execution order), or from an automatic
partition into contiguous stages that balances the bytes each stage holds for training
(weights + gradients + optimizer slots). It is a pure function of the model, so every
rank computes the same plan without talking.

A tensor produced on stage s and used on stages t > s is a *boundary*: it is sent from s
to every consumer stage (skip connections may cross several stages), and its gradient
comes back from each of them. Model inputs are read by every stage that uses them.

Nested functional models (a keras-hub backbone inside a task model) are flattened into
their layers' calls, so stages cut through them; keras op nodes (``x[:, 0]``, reshapes,
``keras.ops`` calls) are weightless calls. A layer called on several stages (a tied
embedding) is held by each of them: the first stage's copy is the master, the others
replicas whose gradients are summed with the master's every step (``ties``).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._core.errors import PipelineError
from .._core.graph import ModelGraph, model_graph

#: Optimizer slot variables per trainable weight assumed when balancing (Adam: 2).
DEFAULT_OPTIMIZER_SLOTS = 2


@dataclass(frozen=True)
class Boundary:
    """A tensor sent from its producer stage to each (later) consumer stage."""

    index: int
    tensor: str
    shape: tuple
    dtype: str
    producer: int
    consumers: tuple[int, ...]

    @property
    def differentiable(self) -> bool:
        """Whether a gradient flows back through this boundary (float tensors)."""
        return np.dtype(self.dtype).kind == "f"


@dataclass(frozen=True)
class Tie:
    """A layer with weights called on several stages: one logical set of variables."""

    layer: str
    stages: tuple[int, ...]  # the first holds the master copy, the others replicas


@dataclass(frozen=True)
class Stage:
    """One stage: its calls (execution order), inputs, outputs and sizes."""

    index: int
    calls: tuple[int, ...]
    layer_names: tuple[str, ...]
    data_inputs: tuple[int, ...]  # positions in the model's flattened inputs
    inputs: tuple[int, ...]  # boundary indices received
    outputs: tuple[int, ...]  # boundary indices produced (sent)
    weight_bytes: int
    trainable_bytes: int
    has_regularizer: bool
    replicas: tuple[str, ...] = ()  # tied layers whose master copy is on an earlier stage

    def training_bytes(self, optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS) -> int:
        """Weights + gradients + optimizer slots this stage holds while training."""
        return self.weight_bytes + self.trainable_bytes * (1 + optimizer_slots)


def _layer_bytes(layer) -> tuple[int, int]:
    """(all, trainable) weight bytes; keras op nodes (GetItem, ...) hold none."""
    total = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in getattr(layer, "weights", ()))
    trainable = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                    for v in getattr(layer, "trainable_weights", ()))
    return total, trainable


class Plan:
    """A partition of a model into pipeline stages (see module docstring).

    Attributes: ``num_stages``, ``stages`` (:class:`Stage`), ``boundaries``
    (:class:`Boundary`), ``source`` ('markers', 'split_after' or 'auto') and
    ``split_after`` (the layer names ending each stage but the last).
    """

    def __init__(self, graph: ModelGraph, stage_of_call: Sequence[int], source: str,
                 optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS) -> None:
        self.graph = graph
        self.source = source
        self.optimizer_slots = optimizer_slots
        self.stage_of_call = list(stage_of_call)
        self.num_stages = max(self.stage_of_call) + 1 if self.stage_of_call else 1
        self.ties = self._check_layers_in_one_stage()
        self.boundaries = self._boundaries()
        self.stages = self._stages()

    # -- construction --------------------------------------------------------------------
    def _check_layers_in_one_stage(self) -> list[Tie]:
        """The layers with weights called on several stages (tied); each must hold only
        trainable weights (a replica of a moving statistic would drift from its master)."""
        stages_of_layer: dict[int, list[int]] = {}
        for call in self.graph.calls:
            used = stages_of_layer.setdefault(id(call.layer), [])
            if self.stage_of_call[call.index] not in used:
                used.append(self.stage_of_call[call.index])
        ties, seen = [], set()
        for call in self.graph.calls:
            used = stages_of_layer[id(call.layer)]
            if len(used) < 2 or id(call.layer) in seen or not getattr(call.layer, "weights", None):
                continue
            seen.add(id(call.layer))
            if call.layer.non_trainable_weights:
                where = " and ".join(str(s) for s in sorted(used))
                raise PipelineError(
                    f"layer {call.layer.name!r} is called in stages {where} and holds non-trainable "
                    "weights, which its copies would update apart. Move the SplitLayer (or the "
                    "split point) so that every call of this layer falls into one stage, or use "
                    "separate layers.")
            ties.append(Tie(call.layer.name, tuple(sorted(used))))
        for s in range(self.num_stages):
            if not any(self.stage_of_call[c.index] == s and not c.is_split for c in self.graph.calls):
                raise PipelineError(
                    f"pipeline stage {s} of {self.num_stages} holds no layer. Put at least one "
                    "layer between consecutive SplitLayers / split points, or use fewer stages."
                )
        return ties

    def _root(self) -> dict[str, str]:
        """SplitLayer outputs are their inputs: tensor name -> name of the real tensor."""
        root: dict[str, str] = {}
        for call in self.graph.calls:
            if call.is_split:
                root[call.outputs[0]] = root.get(call.inputs[0], call.inputs[0])
        return root

    def _boundaries(self) -> list[Boundary]:
        root = self._root()
        producer_call = {t: c.index for c in self.graph.calls if not c.is_split for t in c.outputs}
        consumers: dict[str, set[int]] = {}
        for call in self.graph.calls:
            if call.is_split:
                continue
            s = self.stage_of_call[call.index]
            for t in call.inputs:
                r = root.get(t, t)
                if r in producer_call and self.stage_of_call[producer_call[r]] != s:
                    consumers.setdefault(r, set()).add(s)
        last = self.num_stages - 1
        for t in self.graph.outputs:
            r = root.get(t, t)
            if r in producer_call and self.stage_of_call[producer_call[r]] != last:
                consumers.setdefault(r, set()).add(last)
        out = []
        for t in sorted(consumers, key=lambda name: (producer_call[name], name)):
            info = self.graph.tensors[t]
            src = self.stage_of_call[producer_call[t]]
            bad = [c for c in consumers[t] if c < src]
            if bad:  # pragma: no cover - prevented by how stages are assigned
                raise PipelineError(f"tensor {t} flows backwards from stage {src} to {bad}")
            out.append(Boundary(len(out), t, info.shape, info.dtype, src, tuple(sorted(consumers[t]))))
        return out

    def _stages(self) -> list[Stage]:
        root = self._root()
        input_pos = {t: j for j, t in enumerate(self.graph.inputs)}
        stages = []
        seen_layers: set[int] = set()
        for s in range(self.num_stages):
            calls = [c for c in self.graph.calls if self.stage_of_call[c.index] == s]
            data = sorted({input_pos[root.get(t, t)] for c in calls if not c.is_split
                           for t in c.inputs if root.get(t, t) in input_pos})
            weight = trainable = 0
            reg = False
            names, replicas, mine = [], [], set()
            for c in calls:
                if c.is_split or id(c.layer) in mine:
                    continue
                mine.add(id(c.layer))
                if id(c.layer) in seen_layers:  # a tied layer's replica
                    replicas.append(c.layer.name)
                else:
                    seen_layers.add(id(c.layer))
                    names.append(c.layer.name)
                w, tw = _layer_bytes(c.layer)
                weight += w
                trainable += tw
                reg = reg or any(getattr(v, "regularizer", None) is not None
                                 for v in getattr(c.layer, "trainable_weights", ()))
            stages.append(Stage(
                index=s,
                calls=tuple(c.index for c in calls),
                layer_names=tuple(names),
                data_inputs=tuple(data),
                inputs=tuple(b.index for b in self.boundaries if s in b.consumers),
                outputs=tuple(b.index for b in self.boundaries if b.producer == s),
                weight_bytes=weight,
                trainable_bytes=trainable,
                has_regularizer=reg,
                replicas=tuple(replicas),
            ))
        return stages

    # -- inspection ----------------------------------------------------------------------------
    @property
    def split_after(self) -> list[str] | None:
        """Layer names ending each stage but the last (None if stages interleave)."""
        order = [self.stage_of_call[c.index] for c in self.graph.calls]
        if order != sorted(order):
            return None
        names = []
        for s in range(self.num_stages - 1):
            last = [c for c in self.graph.calls if self.stage_of_call[c.index] == s][-1]
            names.append(last.layer.name)
        return names

    def stage_of_layer(self, name: str) -> int:
        """The stage the layer ``name`` runs on."""
        for call in self.graph.calls:
            if call.layer.name == name:
                return self.stage_of_call[call.index]
        raise KeyError(f"no layer named {name!r} in model {self.graph.model_name!r}")

    def with_split_after(self, split_after: Sequence[str]) -> Plan:
        """A new plan of the same model whose stages end after the named layers."""
        return Plan(self.graph, _stages_from_split_after(self.graph, split_after),
                    "split_after", self.optimizer_slots)

    def summary(self, print_fn=print) -> str:
        """Layers, bytes and boundary tensors per stage; printed and returned."""
        buf = io.StringIO()
        total = sum(st.training_bytes(self.optimizer_slots) for st in self.stages) or 1
        buf.write(f"Pipeline plan of {self.graph.model_name!r}: {self.num_stages} stages "
                  f"({self.source})\n")
        for st in self.stages:
            tb = st.training_bytes(self.optimizer_slots)
            buf.write(f"stage {st.index}: {len(st.layer_names)} layers, weights {st.weight_bytes} B, "
                      f"weights+grads+slots {tb} B ({tb / total:.0%})\n")
            buf.write(f"  layers: {', '.join(st.layer_names)}\n")
            if st.replicas:
                buf.write(f"  replicas of tied layers: {', '.join(st.replicas)}\n")
            if st.data_inputs:
                buf.write(f"  reads model inputs: {', '.join(self.graph.input_layer_names[j] for j in st.data_inputs)}\n")
            for b in st.inputs:
                bd = self.boundaries[b]
                buf.write(f"  receives {bd.tensor} {bd.shape} {bd.dtype} from stage {bd.producer}\n")
            for b in st.outputs:
                bd = self.boundaries[b]
                buf.write(f"  sends {bd.tensor} {bd.shape} {bd.dtype} to stage(s) "
                          f"{', '.join(map(str, bd.consumers))}\n")
        text = buf.getvalue()
        if print_fn is not None:
            print_fn(text.rstrip("\n"))
        return text

    def __repr__(self) -> str:
        return (f"Plan({self.graph.model_name!r}, num_stages={self.num_stages}, source={self.source!r}, "
                f"split_after={self.split_after})")


# -- ways to assign stages -------------------------------------------------------------------
def stages_from_markers(graph: ModelGraph) -> list[int]:
    """Stage of a call = the most SplitLayers on any path from the inputs to it.

    A call feeding no SplitLayer then moves as late as its consumers allow (a branch that
    starts at a model input and joins on stage 2 runs on stage 2, not on stage 0 with its
    result sent over).
    """
    tensor_stage = {t: 0 for t in graph.inputs}
    stage_of_call = []
    for call in graph.calls:
        s = max((tensor_stage.get(t, 0) for t in call.inputs), default=0)
        stage_of_call.append(s)
        for t in call.outputs:
            tensor_stage[t] = s + 1 if call.is_split else s
    last = max(stage_of_call, default=0)
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    for call in reversed(graph.calls):
        if call.is_split:
            continue
        users = [graph.calls[d] for t in call.outputs for d in consumers.get(t, [])]
        if any(u.is_split for u in users):
            continue
        late = min([stage_of_call[u.index] for u in users]
                   + ([last] if outputs.intersection(call.outputs) else []), default=last)
        stage_of_call[call.index] = max(stage_of_call[call.index], late)
    return stage_of_call


def _stages_from_split_after(graph: ModelGraph, split_after: Sequence[str]) -> list[int]:
    position: dict[str, int] = {}
    for call in graph.calls:
        position[call.layer.name] = call.index  # the layer's last call
    for name in split_after:
        if name not in position:
            known = ", ".join(c.layer.name for c in graph.calls)
            raise PipelineError(f"split_after names {name!r}, which is no layer of model "
                                f"{graph.model_name!r}; its layers are: {known}.")
    cuts = [position[n] + 1 for n in split_after]
    if cuts != sorted(cuts) or len(set(cuts)) != len(cuts):
        raise PipelineError(f"split_after={list(split_after)} is not in execution order (or names "
                            "a layer twice); list the layers in the order the model runs them.")
    if cuts and cuts[-1] >= len(graph.calls):
        raise PipelineError(f"split_after ends with the model's last layer {split_after[-1]!r}, "
                            "which would leave the last stage empty.")
    stage_of_call, s = [], 0
    for call in graph.calls:
        while s < len(cuts) and call.index >= cuts[s]:
            s += 1
        stage_of_call.append(s)
    return stage_of_call


def _allowed_cuts(graph: ModelGraph) -> list[bool]:
    """cut[i]: may a stage start at call i? Not inside the calls of one shared layer."""
    n = len(graph.calls)
    allowed = [True] * (n + 1)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for call in graph.calls:
        first.setdefault(id(call.layer), call.index)
        last[id(call.layer)] = call.index
    for key, f in first.items():
        for i in range(f + 1, last[key] + 1):
            allowed[i] = False
    return allowed


def _auto_stages(graph: ModelGraph, p: int, optimizer_slots: int) -> list[int]:
    """Contiguous stages minimising the largest stage's training bytes, then the bytes cut.

    The calls of a shared layer stay in one stage where that partition exists; otherwise (a
    tied embedding used by the first and the last call) the layer is tied across stages.
    """
    try:
        return _auto_stages_within(graph, p, optimizer_slots, _allowed_cuts(graph))
    except PipelineError:
        if p > len(graph.calls):
            raise
        return _auto_stages_within(graph, p, optimizer_slots, [True] * (len(graph.calls) + 1))


def _auto_stages_within(graph: ModelGraph, p: int, optimizer_slots: int, allowed: list[bool]) -> list[int]:
    """The partition of ``_auto_stages`` with stages starting only where ``allowed``."""
    n = len(graph.calls)
    if p > n:
        raise PipelineError(f"num_pipeline_stages={p} but model {graph.model_name!r} has only {n} "
                            "layer calls; use at most that many stages.")
    seen: set[int] = set()
    cost = []
    for call in graph.calls:
        if id(call.layer) in seen:
            cost.append(0)
            continue
        seen.add(id(call.layer))
        w, tw = _layer_bytes(call.layer)
        cost.append(w + tw * (1 + optimizer_slots))
    prefix = np.concatenate([[0], np.cumsum(cost, dtype=np.int64)]).tolist()
    # Bytes per sample crossing a cut before call i (what pipelining sends per micro-batch).
    producer = graph.producer()
    last_use: dict[str, int] = {}
    for call in graph.calls:
        for t in call.inputs:
            last_use[t] = max(last_use.get(t, -1), call.index)
    for t in graph.outputs:
        last_use[t] = n
    cut_bytes = [0] * (n + 1)
    for t, end in last_use.items():
        if t not in producer:
            continue
        for i in range(producer[t] + 1, min(end, n - 1) + 1):
            cut_bytes[i] += graph.tensors[t].nbytes_per_sample
    inf = float("inf")
    # Pass 1: the smallest achievable largest stage.
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0
    for k in range(1, p + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or (i > 0 and not allowed[i]):
                    continue
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j] = value
    limit = best[p][n]
    if limit == inf:
        raise PipelineError(f"model {graph.model_name!r} cannot be cut into {p} stages without "
                            "splitting the calls of a shared layer; use fewer stages.")
    # Pass 2: among partitions reaching that limit, the fewest bytes crossing cuts.
    sent = [[inf] * (n + 1) for _ in range(p + 1)]
    back = [[-1] * (n + 1) for _ in range(p + 1)]
    sent[0][0] = 0
    for k in range(1, p + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                if sent[k - 1][i] == inf or (i > 0 and not allowed[i]):
                    continue
                if prefix[j] - prefix[i] > limit:
                    continue
                value = sent[k - 1][i] + (cut_bytes[i] if i > 0 else 0)
                if value < sent[k][j]:
                    sent[k][j], back[k][j] = value, i
    starts, j = [], n
    for k in range(p, 0, -1):
        i = back[k][j]
        starts.append(i)
        j = i
    starts.reverse()
    stage_of_call, s = [], 0
    for idx in range(n):
        while s + 1 < p and idx >= starts[s + 1]:
            s += 1
        stage_of_call.append(s)
    return stage_of_call


def plan(model, num_pipeline_stages: int | None = None, *, split_after: Sequence[str] | None = None,
         optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS, use_markers: bool = True) -> Plan:
    """The pipeline plan of ``model`` (functional or Sequential Keras model).

    With ``SplitLayer`` markers the stages follow them (``num_pipeline_stages``, if given,
    must agree). ``split_after`` lists layer names after which a new stage starts. Without
    either (or with ``use_markers=False``), ``num_pipeline_stages`` contiguous stages balancing weights + gradients +
    ``optimizer_slots`` slots per trainable weight are chosen.
    """
    if num_pipeline_stages is not None and (
            not isinstance(num_pipeline_stages, int | np.integer) or num_pipeline_stages < 1):
        raise PipelineError(f"num_pipeline_stages must be a positive integer, got {num_pipeline_stages!r}.")
    graph = model_graph(model, flatten_nested=True)
    markers = [c.layer.name for c in graph.calls if c.is_split] if use_markers else []
    if split_after is not None:
        stage_of_call = _stages_from_split_after(graph, list(split_after))
        source = "split_after"
        given = len(split_after) + 1
        if num_pipeline_stages is not None and num_pipeline_stages != given:
            raise PipelineError(f"split_after names {len(split_after)} split points ({given} stages) "
                                f"but num_pipeline_stages={num_pipeline_stages}; make them agree.")
    elif markers:
        stage_of_call = stages_from_markers(graph)
        source = "markers"
        found = max(stage_of_call) + 1
        if graph.outputs and all(t in {o for c in graph.calls if c.is_split for o in c.outputs}
                                 for t in graph.outputs):
            raise PipelineError("a SplitLayer produces the model's output; remove the SplitLayer "
                                "after the last layer.")
        if num_pipeline_stages is not None and num_pipeline_stages != found:
            raise PipelineError(
                f"model {graph.model_name!r} has SplitLayer markers ({', '.join(markers)}) that cut it "
                f"into {found} stages, but num_pipeline_stages={num_pipeline_stages}. Pass "
                f"num_pipeline_stages={found} (or leave it out), or move/remove SplitLayers."
            )
    else:
        if num_pipeline_stages is None:
            raise PipelineError(
                f"model {graph.model_name!r} has no SplitLayer markers, so the number of stages is "
                "unknown: pass num_pipeline_stages=p (stages are then balanced automatically), or "
                "mark stage ends with x = tnt.keras.layers.SplitLayer()(x)."
            )
        stage_of_call = _auto_stages(graph, int(num_pipeline_stages), optimizer_slots)
        source = "auto"
    return Plan(graph, stage_of_call, source, optimizer_slots)
