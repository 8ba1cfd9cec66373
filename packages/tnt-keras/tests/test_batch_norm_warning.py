"""The small-batch BatchNormalization warning: only where a layer normalises over a rank's
own rows (not under ``sync_batch_norm=True``, whose statistics are the global batch's)."""

from __future__ import annotations

import logging

import keras
import pytest

import tarantella as tnt
from tarantella.data_parallel import _model as dp_model


def bn_model() -> keras.Model:
    inp = keras.Input((4,))
    x = keras.layers.BatchNormalization()(keras.layers.Dense(4)(inp))
    return keras.Model(inp, keras.layers.Dense(1)(x))


@pytest.mark.parametrize("sync", [False, True])
def test_warns_only_for_rank_local_statistics(sync, monkeypatch, caplog):
    model = tnt.Model(bn_model(), sync_batch_norm=sync)
    monkeypatch.setattr(dp_model._runtime, "get_size", lambda: 4)  # as if on 4 ranks: 2 rows each
    with caplog.at_level(logging.WARNING):
        model._warn_small_batch_norm(8)
    warned = any("holds only 2 samples" in r.getMessage() for r in caplog.records)
    assert warned is not sync, [r.getMessage() for r in caplog.records]
