"""``SplitLayer`` (``tnt.keras.layers``): where a pipeline stage ends.

Everything computed before it belongs to one stage, everything after it to the next (see
docs/pipelining.md). It is an identity and serialises like any Keras layer, so a model
with markers trains, saves and loads unchanged in plain Keras.
"""

from __future__ import annotations

import keras


@keras.saving.register_keras_serializable(package="tarantella")
class SplitLayer(keras.layers.Layer):
    """Identity marker between two pipeline stages: ``x = SplitLayer()(x)``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs):
        """The identity: the marker only tells the planner where a stage ends."""
        return inputs

    def compute_output_shape(self, input_shape):
        """Unchanged: the marker is an identity."""
        return input_shape

