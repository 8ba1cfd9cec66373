"""Real models, DATA strategy: keras-hub Transformers and keras.applications'
MobileNetV3Small built from constructor arguments (no downloads) train on N ranks as in
serial Keras, in the same job.

Every Transformer looks tokens up in an Embedding, so its gradient holds tf.IndexedSlices:
with Adam, serial Keras' update of the slices is not that of their dense sum (issue 27).
MobileNetV3Small normalises batches: with ``sync_batch_norm=True`` over the global batch
as serial Keras does, trained with SGD (Adam turns the float32 order of the gathered
statistics into full steps where a gradient is near zero: docs/models.md).
Each case trains serially (plain Keras; the references spread over the ranks,
jobs/_serial_refs.py) and with tnt.Model from the same initial weights on the same global
batches (the Transformers' uneven over the ranks, a smaller last batch) and records the
largest differences to serial: History, final weights, predict.
"""

from __future__ import annotations

import hashlib
import time

import _job
import _serial_refs
import keras
import keras_hub
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

VOCAB, LENGTH, SAMPLES, BATCH, EPOCHS = 24, 8, 27, 10, 2  # 3 steps an epoch, the last of 7 samples


def _head(backbone: keras.Model, inputs: dict) -> keras.Model:
    """The backbone's sequence output, mean-pooled, into a 3-class softmax."""
    out = backbone(inputs)
    x = out["sequence_output"] if isinstance(out, dict) else out
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(x))


def _token_inputs(names: list[str]) -> dict:
    return {n: keras.Input((LENGTH,), dtype="int32", name=n) for n in names}


def gpt2() -> keras.Model:
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=LENGTH, dropout=0.0)
    return _head(backbone, _token_inputs(["token_ids", "padding_mask"]))


def bert() -> keras.Model:
    backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=LENGTH, dropout=0.0)
    return _head(backbone, _token_inputs(["token_ids", "segment_ids", "padding_mask"]))


def llama() -> keras.Model:
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=2,
                                              num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)
    return _head(backbone, _token_inputs(["token_ids", "padding_mask"]))


def gpt2_causal_lm() -> keras.Model:
    """The task model: its token embedding is tied to the output projection."""
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=LENGTH, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


# MobileNetV3Small, minimalistic, 64x64, one epoch of 2 even steps of 8, SGD without momentum:
# the cheapest shape measured float32-exact (docs/models.md). Cheaper ones were not: the 1e-7
# of the statistics' float32 order grew, by the second epoch, to History 6e-2 apart at 32x32
# (width 0.25, SGD) and to 2e-3 at 64x64 width 0.25 with an uneven last batch (with
# momentum 0.9: History 2e-7, weights 1.2e-4).
IMAGE, IMAGES, IMAGE_BATCH, IMAGE_EPOCHS = 64, 16, 8, 1


def mobilenet() -> keras.Model:
    """keras.applications' MobileNetV3Small, minimalistic; no dropout (its random masks
    would differ from serial's)."""
    return keras.applications.MobileNetV3Small(input_shape=(IMAGE, IMAGE, 3), minimalistic=True, weights=None,
                                               classes=3, include_preprocessing=False, dropout_rate=0.0)


MODELS = {"gpt2": gpt2, "bert": bert, "llama": llama, "gpt2_causal_lm": gpt2_causal_lm, "mobilenet": mobilenet}
CNNS = ("mobilenet",)  # trained with SGD and sync_batch_norm=True


def data(name: str, seed: int):
    rng = np.random.default_rng(seed)
    if name in CNNS:
        images = rng.normal(size=(IMAGES, IMAGE, IMAGE, 3)).astype("float32")
        return images, rng.integers(0, 3, size=IMAGES).astype("int32")
    ids = rng.integers(1, VOCAB, size=(SAMPLES, LENGTH)).astype("int32")  # tokens repeat in a batch
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    if name == "bert":
        x["segment_ids"] = np.zeros_like(ids)
    if name == "gpt2_causal_lm":
        return x, np.roll(ids, -1, axis=1)  # next token
    return x, (ids[:, 0] % 3).astype("int32")


def compile_(model: keras.Model, name: str) -> None:
    if name in CNNS:
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy",
                      metrics=["sparse_categorical_accuracy"])
        return
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=name == "gpt2_causal_lm")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, metrics=["sparse_categorical_accuracy"])


def build(name: str, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return MODELS[name]()


def batch_and_epochs(name: str) -> tuple[int, int]:
    return (IMAGE_BATCH, IMAGE_EPOCHS) if name in CNNS else (BATCH, EPOCHS)


def _dataset(name: str):
    x, y = data(name, seed=3)
    return x, tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_and_epochs(name)[0])


def serial_reference(name: str) -> dict:
    """Plain Keras from the seed-5 weights: History, final weights, predict."""
    x, ds = _dataset(name)
    batch, epochs = batch_and_epochs(name)
    serial = build(name, 5)
    initial = serial.get_weights()
    compile_(serial, name)
    history = serial.fit(ds, epochs=epochs, verbose=0).history
    return {"initial": initial, "history": history, "weights": serial.get_weights(),
            "predict": serial.predict(x, batch_size=batch, verbose=0)}


def run_case(name: str, ref: dict | None) -> dict:
    """tnt.Model from the seed-5 weights on the same batches; the master (``ref`` not
    None) compares with the serial reference."""
    x, ds = _dataset(name)
    batch, epochs = batch_and_epochs(name)
    initial = build(name, 5).get_weights()
    model = tnt.Model(build(name, 100 + tnt.get_rank()), sync_batch_norm=name in CNNS)  # rank 0's initial weights must win
    model.set_weights(initial)
    compile_(model, name)
    history = model.fit(ds, epochs=epochs, verbose=0).history
    weights = model.get_weights()
    predicted = model.predict(x, batch_size=batch, verbose=0)
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()
    same = len(set(tnt_comm.allgather_object(digest)))
    if ref is None:
        return {}
    return {
        "initial_diff": _job.max_abs_diff(ref["initial"], initial),
        "history_diff": _job.history_diff(ref["history"], history),
        "weight_diff": _job.max_abs_diff(ref["weights"], weights),
        "weight_rel_diff": _job.max_rel_diff(ref["weights"], weights),
        "predict_diff": _job.max_abs_diff(ref["predict"], predicted),
        "history_keys": [sorted(ref["history"]), sorted(history)],
        "ranks_identical": same == 1,
        "variables": len(weights),
    }


#: seconds of each serial reference (measured on 2 busy cores), to share them out evenly
SERIAL_SECONDS = {"gpt2": 48, "bert": 50, "llama": 37, "gpt2_causal_lm": 22, "mobilenet": 59}


def run_all(names: list[str]) -> dict:
    refs = _job.timed("serial references", lambda: _serial_refs.shared(names, serial_reference, SERIAL_SECONDS))
    results = {}
    for name in names:
        t0 = time.perf_counter()
        results[name] = _job.timed(name, lambda name=name: run_case(name, refs.get(name)))
        if name in refs:  # where the part's time goes: the serial reference (on some rank), the tnt run
            results[name]["seconds"] = {"serial": refs[name]["seconds"], "tnt": time.perf_counter() - t0}
    return results


def main() -> None:
    out = _job.out_path()
    _job.write(out, {"ranks": tnt.get_size(), "cases": run_all(_job.only(MODELS))})


if __name__ == "__main__":
    main()
