"""``tnt.keras``: Tarantella's Keras extensions (``tnt.keras.callbacks``)."""

from . import callbacks

__all__ = ["callbacks"]
