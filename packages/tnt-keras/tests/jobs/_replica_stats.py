"""A model with BatchNormalization trained by data replicas of a split layout (ALL): each
replica's moving statistics follow its own slices of the batches, so they must be averaged
(as DATA does) before predict/evaluate after fit and before save. Without that the replicas
predict with different models and the file holds replica 0's statistics alone."""

from __future__ import annotations

import os
import tempfile

import keras
import numpy as np

import tarantella as tnt
import tnt_comm


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="d0")(inp)
    h = keras.layers.BatchNormalization(name="bn0")(h)
    h = keras.layers.Dense(16, activation="relu", name="d1")(h)
    h = keras.layers.BatchNormalization(name="bn1")(h)
    return keras.Model(inp, keras.layers.Dense(3, name="out")(h))


def one_model_after_fit(**layout) -> dict:
    """Predictions and loss of the trained model vs the model loaded from its file (same
    layout) and vs plain Keras' load of that file; and whether all ranks agree."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32") * (1 + np.arange(96)[:, None] / 20)  # slices differ
    y = rng.integers(0, 3, 96)
    model = tnt.Model(_model(), **layout)
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    trained = model.predict(x, batch_size=16, verbose=0)
    loss = float(model.evaluate(x, y, batch_size=16, verbose=0))
    folder = tnt_comm.broadcast_object(tempfile.mkdtemp(prefix="tnt-bn-") if tnt.is_master_rank() else None, 0)
    path = os.path.join(folder, "bn.keras")
    model.save(path)
    loaded = tnt.models.load_model(path, **layout)
    reloaded = loaded.predict(x, batch_size=16, verbose=0)
    plain = keras.saving.load_model(path).predict(x, batch_size=16, verbose=0) if tnt.is_master_rank() else None
    losses = tnt_comm.allgather_object(loss)
    out = {
        "trained_vs_reloaded_predict_diff": float(np.abs(trained - reloaded).max()),
        "trained_vs_reloaded_loss_diff": abs(loss - float(loaded.evaluate(x, y, batch_size=16, verbose=0))),
        "ranks_loss_spread": max(losses) - min(losses),
        "plain_keras_vs_reloaded_predict_diff": tnt_comm.broadcast_object(
            float(np.abs(plain - reloaded).max()) if plain is not None else None, 0),
    }
    tnt_comm.barrier()
    return out
