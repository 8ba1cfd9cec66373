"""build_variables (tnt's first call): metrics, loss and optimizer are built before any step
is traced — from a functional model's output shapes where that is enough, else by a
forward pass. In one process: no launch."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tarantella._core.sync import build_variables


def _dataset(x, y, batch: int):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def test_a_static_batch_builds_a_sparse_loss_with_as_many_rows_as_the_targets():
    # The element spec has a static batch of 32: targets (32,), outputs built from the model's
    # (None, 10) spec must have 32 rows too (1 row made SparseCategoricalCrossentropy raise).
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Dense(16, activation="relu")(inputs)))
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    rng = np.random.default_rng(0)
    data = _dataset(rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 10, 64), 32)
    assert data.element_spec[0].shape[0] == 32
    build_variables(model, model, data, with_metrics=True)
    assert model.optimizer.built
    assert all(getattr(m, "built", True) for m in model.metrics)
    assert float(model.optimizer.iterations.numpy()) == 0.0  # built, no step taken


def test_a_sequence_axis_unknown_to_the_outputs_builds_by_a_forward_pass():
    # Outputs (None, None, 12): the sequence length is known only from the data (7 here).
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(20, 4)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(12)(h))
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    rng = np.random.default_rng(1)
    data = _dataset(rng.integers(0, 20, (16, 7)).astype("int32"), rng.integers(0, 12, (16, 7)), 8)
    build_variables(model, model, data, with_metrics=True)
    assert model.optimizer.built
    assert all(getattr(m, "built", True) for m in model.metrics)


def test_broadcast_chunks_start_anew_at_a_dtype_change_and_keep_the_byte_limit():
    from tarantella._core.sync import _chunks

    f32 = [keras.Variable(np.zeros(n, "float32")) for n in (4, 4, 8)]  # 16, 16, 32 bytes
    f16 = keras.Variable(np.zeros(4, "float16"))  # 8 bytes
    last = keras.Variable(np.zeros(2, "float32"))
    runs = _chunks([f32[0], f32[1], f16, f32[2], last], 32)
    assert [[id(v) for v in r] for r in runs] == [[id(f32[0]), id(f32[1])], [id(f16)], [id(f32[2])], [id(last)]]
