"""``tnt.keras.callbacks.Callback``: run a user callback on all ranks or the master only.

Built-in Keras callbacks need no wrapping: logs are global on every rank already (metric
states are reduced across ranks in each step), so EarlyStopping, ReduceLROnPlateau and
friends take the same decision everywhere, and files/progress are written by the master.
Wrap your own callback when it writes files or prints (``run_on_all_ranks=False``), or
when it adds rank-local numbers to the logs (``aggregate_logs=True`` averages those).
"""

from __future__ import annotations

import keras
import numpy as np

import tnt_comm

from .._core.runtime import get_size, is_master_rank

__all__ = ["Callback"]

_EPOCH_LEVEL_HOOKS = ("on_epoch_end", "on_train_end", "on_test_end")


class Callback(keras.callbacks.Callback):
    """Wrap ``callback`` so that it runs on every rank or on the master rank only.

    Args:
        callback: any ``keras.callbacks.Callback``.
        aggregate_logs: average numeric log entries across ranks before the callback
            sees them at epoch level (``on_epoch_end``, ``on_train_end``, ``on_test_end``).
            Entries computed by the model are already global and are unchanged by this.
        run_on_all_ranks: False runs the callback on the master rank only.
    """

    def __init__(self, callback: keras.callbacks.Callback, aggregate_logs: bool = True,
                 run_on_all_ranks: bool = True) -> None:
        super().__init__()
        if not isinstance(callback, keras.callbacks.Callback):
            raise TypeError(f"expected a keras.callbacks.Callback, got {type(callback).__name__}")
        self.callback = callback
        self.aggregate_logs = aggregate_logs
        self.run_on_all_ranks = run_on_all_ranks

    def set_model(self, model) -> None:
        """Set the model on this wrapper and on the wrapped callback."""
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params) -> None:
        """Set the run's parameters on this wrapper and on the wrapped callback."""
        super().set_params(params)
        self.callback.set_params(params)

    def _runs_here(self) -> bool:
        return self.run_on_all_ranks or is_master_rank()

    def _aggregate(self, logs):
        if not self.aggregate_logs or not logs or get_size() == 1:
            return logs
        keys = sorted(k for k, v in logs.items() if isinstance(v, int | float | np.floating | np.integer))
        # Every rank must reduce the same keys in the same order; check before reducing.
        if tnt_comm.allgather_object(keys) != [keys] * get_size():
            raise RuntimeError(
                "tnt.keras.callbacks.Callback: ranks have different log keys, so they cannot "
                "be aggregated; pass aggregate_logs=False."
            )
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        mean = tnt_comm.allreduce(values, tnt_comm.Op.AVG)
        return {**logs, **dict(zip(keys, mean.tolist()))}

    def _forward(self, hook: str, index: int | None, logs) -> None:
        if hook in _EPOCH_LEVEL_HOOKS:
            logs = self._aggregate(logs)
        if self._runs_here():
            target = getattr(self.callback, hook)
            target(logs) if index is None else target(index, logs)


def _make_hook(hook: str):
    indexed = "batch" in hook or "epoch" in hook

    if indexed:
        def method(self, index, logs=None):
            self._forward(hook, index, logs)
    else:
        def method(self, logs=None):
            self._forward(hook, None, logs)

    method.__name__ = hook
    return method


for _hook in (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
    "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
    "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
    "on_predict_batch_begin", "on_predict_batch_end",
):
    setattr(Callback, _hook, _make_hook(_hook))
