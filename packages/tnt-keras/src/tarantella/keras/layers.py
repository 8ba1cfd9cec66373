"""``tnt.keras.layers``: layers Tarantella adds to Keras."""

from .._batch_norm import SyncBatchNormalization

__all__ = ["SyncBatchNormalization"]
