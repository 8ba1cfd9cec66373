"""``tnt.keras``: Tarantella's Keras extensions (``tnt.keras.callbacks``, ``tnt.keras.layers``)."""

from . import callbacks, layers

__all__ = ["callbacks", "layers"]
