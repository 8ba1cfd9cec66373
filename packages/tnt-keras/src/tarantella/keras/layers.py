"""``tnt.keras.layers``: layers Tarantella adds to Keras."""

from .._core.batch_norm import SyncBatchNormalization
from .._core.split_layer import SplitLayer

__all__ = ["SplitLayer", "SyncBatchNormalization"]
