"""The streamed writer (``_core.streamed_files``) in one process, against Keras' own save.

A trained serial model answers the writer's requests itself (what the stages do in a
launch); the file written from its deferred twin must be the one ``model.save`` /
``save_weights`` writes: the same groups, attributes and bitwise the same arrays, and the
same ``config.json``. Covers nested models, BatchNormalization's non-trainable variables,
an inner optimizer (LossScaleOptimizer) and a compiled model never trained.
"""

from __future__ import annotations

import io
import json
import zipfile

import h5py
import keras
import numpy as np
import pytest

from tarantella._core import internals
from tarantella._core import streamed_files as streamed
from tarantella._core.deferred import deferred_variables
from tarantella._core.serial_files import clone_optimizer, optimizer_keys


def nested_model() -> keras.Model:
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, name="inner_dense"),
                              keras.layers.BatchNormalization(name="inner_bn")], name="block")
    inputs = keras.Input((4,))
    x = keras.layers.Dense(6, activation="relu", name="first")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(inner(x)))


def answering(model: keras.Model):
    """``fetch`` served by ``model`` itself: its layers' weights and its optimizer's variables."""
    layers = {layer.name: layer for layer in internals.all_sublayers(model) if not isinstance(layer, keras.Model)}
    opt = model.optimizer
    slots = dict(zip(optimizer_keys(opt, model), opt.variables)) if opt is not None and opt.built else {}

    def fetch(request):
        if isinstance(request, streamed.Weight):
            return np.asarray(layers[request.layer].weights[request.index].numpy())
        return np.asarray(slots[request.key].numpy()) if request.key in slots else None
    return fetch


def contents(f: h5py.File) -> dict:
    out = {}
    f.visititems(lambda name, obj: out.__setitem__(name, (
        {k: str(v) for k, v in obj.attrs.items()}, np.asarray(obj[()]) if isinstance(obj, h5py.Dataset) else None)))
    return out


def differing(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or a[k][0] != b[k][0]
                  or (a[k][1] is not None and not np.array_equal(a[k][1], b[k][1])))


def config(archive: zipfile.ZipFile) -> dict:
    """config.json without Keras' ``shared_object_id`` (an object's address at save time)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "shared_object_id"}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return strip(json.loads(archive.read("config.json")))


def deferred_twin(model: keras.Model, optimizer) -> keras.Model:
    with deferred_variables():
        full = model.__class__.from_config(model.get_config())
    if optimizer is not None:
        full.compile(optimizer=clone_optimizer(optimizer), loss="mse")
    return full


@pytest.mark.parametrize("optimizer, train", [
    (lambda: keras.optimizers.Adam(0.01), True),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)), True),
    (lambda: keras.optimizers.Adam(0.01), False),  # compiled, never trained: an unbuilt optimizer
], ids=["adam", "loss_scale_sgd", "unbuilt"])
def test_streamed_file_is_keras_own_save(tmp_path, optimizer, train):
    keras.utils.set_random_seed(3)
    model = nested_model()
    model.compile(optimizer(), "mse")
    if train:
        model.fit(np.random.rand(16, 4).astype("float32"), np.random.rand(16, 3).astype("float32"), verbose=0)
    full = deferred_twin(model, model.optimizer)
    events = streamed.save_events(full, model.optimizer, model.optimizer.built)
    assert events is not None
    model.save(tmp_path / "keras.keras")
    streamed.write_model(str(tmp_path / "ours.keras"), full, events, answering(model))
    with zipfile.ZipFile(tmp_path / "ours.keras") as a, zipfile.ZipFile(tmp_path / "keras.keras") as b:
        assert a.namelist() == b.namelist()
        assert config(a) == config(b)
        ours = contents(h5py.File(io.BytesIO(a.read("model.weights.h5"))))
        theirs = contents(h5py.File(io.BytesIO(b.read("model.weights.h5"))))
    assert len(ours) > 10 and differing(ours, theirs) == []
    # the weights file alike, and plain Keras loads the streamed file with the same state
    model.save_weights(tmp_path / "keras.weights.h5")
    streamed.write_weights(str(tmp_path / "ours.weights.h5"), events, answering(model))
    with h5py.File(tmp_path / "ours.weights.h5") as a, h5py.File(tmp_path / "keras.weights.h5") as b:
        assert differing(contents(a), contents(b)) == []
    if train:  # (Keras' own loading refuses its own file of an unbuilt optimizer alike)
        loaded = keras.saving.load_model(tmp_path / "ours.keras")
        assert all(np.array_equal(x, y) for x, y in zip(loaded.get_weights(), model.get_weights()))


def test_a_layer_storing_a_computed_value_is_not_streamed():
    """A layer whose save hands the store something else than its variables (a merged
    LoRA kernel) cannot be served by the stages: the save falls back to gathering."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    dense = keras.layers.Dense(3, name="d")
    model = keras.Model(inputs, dense(inputs))
    dense.enable_lora(2)
    full = deferred_twin(model, None)
    assert streamed.save_events(full) is None
