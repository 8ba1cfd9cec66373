"""Boundary shapes of one step, for boundaries with a dynamic (``None``) non-batch axis.

keras-hub backbones take sequences of any length, so the tensors crossing stages have a
``None`` sequence axis. A receiver must know a message's shape before it arrives (its
receive is posted ahead). Every rank of a pipeline holds the step's model inputs, so each
derives the boundary shapes from their shapes alone, without talking: the model's calls
are replayed symbolically (``compute_output_spec``, the way Keras built the graph) on the
inputs' concrete non-batch shapes, once per distinct input shape. Every message is still
checked on receipt against the shape so derived (a clear error on any mismatch).
"""

from __future__ import annotations

import keras

from .._core.errors import PipelineError
from ._plan import Plan


class BoundaryShapes:
    """``shapes(input_shapes)``: per boundary, its non-batch shape on inputs of those shapes."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.static = all(None not in b.shape for b in plan.boundaries)
        self._cache: dict[tuple, list[tuple]] = {}

    def shapes(self, input_shapes: list[tuple]) -> list[tuple]:
        """Per boundary (by index): its shape without the batch axis."""
        if self.static:
            return [tuple(b.shape) for b in self.plan.boundaries]
        key = tuple(tuple(int(d) for d in s[1:]) for s in input_shapes)
        if key not in self._cache:
            self._cache[key] = self._replay(key)
        return self._cache[key]

    def _replay(self, inputs: tuple) -> list[tuple]:
        graph = self.plan.graph
        values: dict[str, object] = {}
        for name, shape in zip(graph.inputs, inputs):
            values[name] = keras.KerasTensor((None, *shape), dtype=graph.keras_tensors[name].dtype)
        wanted = {b.tensor for b in self.plan.boundaries}
        for call in graph.calls:
            if call.is_split:
                values[call.outputs[0]] = values[call.inputs[0]]
                continue
            if wanted.issubset(values):
                break
            by_id = {id(t): values[n] for t, n in zip(call.node.arguments.keras_tensors, call.inputs)}
            args, kwargs = call.node.arguments.fill_in(by_id)
            try:
                out = keras.tree.flatten(call.layer.compute_output_spec(*args, **kwargs))
            except Exception as err:  # any failure: named with the layer and the fix
                raise PipelineError(
                    f"the shapes of the tensors crossing stages depend on the input shapes "
                    f"{[(None, *s) for s in inputs]}, and layer {call.layer.name!r} could not "
                    f"compute its output shape for them ({type(err).__name__}: {err}). Give the "
                    "model's inputs a fixed shape or cut the model elsewhere.") from err
            for name, t in zip(call.outputs, out):
                values[name] = t
        result = []
        for b in self.plan.boundaries:
            shape = tuple(values[b.tensor].shape[1:])
            if None in shape:
                raise PipelineError(
                    f"boundary tensor {b.tensor} has shape {(None, *shape)} even for inputs of "
                    f"shapes {[(None, *s) for s in inputs]}: tensors crossing stages need a shape "
                    "their inputs determine. Cut the model elsewhere.")
            result.append(shape)
        return result
