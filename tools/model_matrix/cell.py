"""One cell of docs/models.md: one model trained under one strategy, against serial Keras.

Launched by tools/model_matrix/run.py as its own job (``tarantella -n N -- cell.py``) so
that a crash or a hang in one cell cannot take the others with it. The master trains the
serial model; every rank trains the tnt model from the same initial weights on the same
global batches; the tnt model is saved and the file opened in plain Keras on the master,
so the weights compared are the ones a user would get back. Writes one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt

VOCAB, LENGTH, SAMPLES, BATCH, EPOCHS = 24, 8, 32, 8, 2
IMAGE, CLASSES = 32, 4


def _head(backbone: keras.Model, inputs: dict) -> keras.Model:
    out = backbone(inputs)
    x = out["sequence_output"] if isinstance(out, dict) else out
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(x))


def _tokens(names):
    return {n: keras.Input((LENGTH,), dtype="int32", name=n) for n in names}


def gpt2_backbone_head():
    import keras_hub
    b = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                      intermediate_dim=32, max_sequence_length=LENGTH, dropout=0.0)
    return _head(b, _tokens(["token_ids", "padding_mask"]))


def bert_backbone_head():
    import keras_hub
    b = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                      intermediate_dim=32, max_sequence_length=LENGTH, dropout=0.0)
    return _head(b, _tokens(["token_ids", "segment_ids", "padding_mask"]))


def llama_backbone_head():
    import keras_hub
    b = keras_hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=2,
                                       num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)
    return _head(b, _tokens(["token_ids", "padding_mask"]))


def gemma_backbone_head():
    import keras_hub
    b = keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                       num_key_value_heads=2, head_dim=8, hidden_dim=32, intermediate_dim=64)
    return _head(b, _tokens(["token_ids", "padding_mask"]))


def gpt2_causal_lm():
    import keras_hub
    b = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                      intermediate_dim=32, max_sequence_length=LENGTH, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=b, preprocessor=None)


def mobilenet_v3_small():
    return keras.applications.MobileNetV3Small(weights=None, input_shape=(IMAGE, IMAGE, 3), classes=CLASSES,
                                               include_preprocessing=False, dropout_rate=0.0)


def resnet50():
    return keras.applications.ResNet50(weights=None, input_shape=(IMAGE, IMAGE, 3), classes=CLASSES)


MODELS = {
    "GPT2Backbone + head": gpt2_backbone_head,
    "GPT2CausalLM": gpt2_causal_lm,
    "BertBackbone + head": bert_backbone_head,
    "LlamaBackbone + head": llama_backbone_head,
    "GemmaBackbone + head": gemma_backbone_head,
    "MobileNetV3Small": mobilenet_v3_small,
    "ResNet50": resnet50,
}

CNNS = ("MobileNetV3Small", "ResNet50")

STRATEGIES = {  # name: (ranks, tnt.Model keyword arguments)
    "DATA": (2, {}),
    "PIPELINING": (2, {"parallel_strategy": tnt.ParallelStrategy.PIPELINING, "num_pipeline_stages": 2,
                       "num_micro_batches": 4}),
    "TENSOR": (2, {"parallel_strategy": tnt.ParallelStrategy.TENSOR, "tensor_parallel_size": 2}),
    "ALL": (4, {"parallel_strategy": tnt.ParallelStrategy.ALL, "num_pipeline_stages": 2,
                "tensor_parallel_size": 2, "num_micro_batches": 4}),
}


def data(name: str):
    rng = np.random.default_rng(3)
    if name in CNNS:
        x = rng.normal(size=(SAMPLES, IMAGE, IMAGE, 3)).astype("float32")
        return x, rng.integers(0, CLASSES, SAMPLES).astype("int32")
    ids = rng.integers(1, VOCAB, size=(SAMPLES, LENGTH)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    if name.startswith("Bert"):
        x["segment_ids"] = np.zeros_like(ids)
    if name == "GPT2CausalLM":
        return x, np.roll(ids, -1, axis=1)
    return x, (ids[:, 0] % 3).astype("int32")


def compile_(model, name):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=name == "GPT2CausalLM")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, metrics=["sparse_categorical_accuracy"])


def build(name, seed):
    keras.utils.set_random_seed(seed)
    return MODELS[name]()


def _max_diff(a, b) -> float:
    """The largest difference relative to the array's magnitude (absolute below 1): batch
    normalisation's moving variances run into the hundreds."""
    def one(x, y):
        x, y = np.asarray(x, "float64"), np.asarray(y, "float64")
        return float(np.max(np.abs(x - y)) / max(1.0, float(np.max(np.abs(x))))) if x.size else 0.0
    return max((one(x, y) for x, y in zip(a, b)), default=0.0)


def run(name: str, strategy: str, directory: str) -> dict:
    x, y = data(name)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    keras_model = build(name, 5)  # before the master's serial model: Keras' auto-names agree
    ref = None
    if tnt.is_master_rank():
        serial = build(name, 5)
        serial.set_weights(keras_model.get_weights())
        compile_(serial, name)
        history = serial.fit(ds, epochs=EPOCHS, verbose=0).history
        ref = {"history": history, "weights": serial.get_weights(),
               "predict": serial.predict(x, batch_size=BATCH, verbose=0)}
    options = dict(STRATEGIES[strategy][1])
    if name in CNNS and strategy == "DATA":  # batch normalisation over the global batch, as serial Keras
        options["sync_batch_norm"] = True
    model = tnt.Model(keras_model, **options)
    compile_(model, name)
    history = model.fit(ds, epochs=EPOCHS, verbose=0).history
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    path = os.path.join(directory, "model.keras")
    model.save(path)
    if ref is None:
        return {}
    saved = keras.models.load_model(path, compile=False)
    keys = sorted(ref["history"]) == sorted(history)
    h = max(abs(a - b) for k in ref["history"] if k in history for a, b in zip(ref["history"][k], history[k]))
    return {"history_diff": h, "history_keys_equal": keys, "history_keys": sorted(history),
            "weight_count": [len(ref["weights"]), len(saved.get_weights())],
            "weight_diff": _max_diff(ref["weights"], saved.get_weights())
            if len(ref["weights"]) == len(saved.get_weights()) else None,
            "predict_diff": _max_diff([ref["predict"]], [predicted]),
            "saved_predict_diff": _max_diff([ref["predict"]], [saved.predict(x, batch_size=BATCH, verbose=0)])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--strategy", required=True, choices=sorted(STRATEGIES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    directory = os.path.dirname(os.path.abspath(args.out))  # the driver's folder, the same on every rank
    try:
        result = {"status": "ran", **run(args.model, args.strategy, directory)}
    except Exception as error:  # the cell records what a user would see
        text = str(error).strip()
        line = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
        result = {"status": "error", "error": line[:300], "traceback": traceback.format_exc()[-2000:]}
        with open(f"{args.out}.rank{tnt.get_rank()}.txt", "w") as f:  # the launcher shows one rank's error
            f.write(result["traceback"])
        if tnt.is_master_rank():
            with open(args.out, "w") as f:
                json.dump(result, f)
        sys.exit(1)
    if tnt.is_master_rank():
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
