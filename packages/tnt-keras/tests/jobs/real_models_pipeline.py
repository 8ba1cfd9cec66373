"""Real models, PIPELINING: keras-hub Transformers built from constructor arguments (no
downloads, the builders of jobs/real_models.py) on 2 stages (automatic partition, m = 4,
Adam), against serial Keras in the same job (issue 27).

What each case exercises: the backbone is a model nested in the task model, so the
partition must cut through its layers; its sequence axis is dynamic (None), so the
boundary shapes come from each step's inputs; BERT's pooled output is a keras op node
(``x[:, 0, :]``); Llama's untied ``reverse_embeddings`` gets no gradient; GPT2CausalLM's
token embedding is tied to its output projection across the two stages (one logical
variable, saved once).

The serial references are trained first, spread over the ranks (jobs/_serial_refs.py);
then every rank builds the serial model (the same Keras objects on every rank, so the
auto-generated names agree) and the pipelined model from the same seed, trained on the
same global batches. Recorded: History, final weights
(by the layers' position in the serial model's weights order), predict, each stage's
share of the parameters; for GPT2CausalLM a save opened in plain Keras.
"""

from __future__ import annotations

import io
import tempfile
import zipfile
from pathlib import Path

import _job
import _serial_refs
import h5py
import keras
import keras_hub
import numpy as np
import tensorflow as tf
from real_models import BATCH, EPOCHS, LENGTH, VOCAB, bert, data, gpt2, llama

import tarantella as tnt
import tnt_comm
from tarantella._core.graph import leaf_layers
from tarantella.pipelining._stages import held_layers


def gpt2_causal_lm() -> keras.Model:
    """The task model with its tied token embedding; two decoder layers, so that both
    stages hold a real share (one layer leaves 16 % on one side of any cut)."""
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=LENGTH, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


MODELS = {"gpt2": gpt2, "bert": bert, "llama": llama, "gpt2_causal_lm": gpt2_causal_lm}


def build(name: str) -> keras.Model:
    keras.utils.set_random_seed(5)
    return MODELS[name]()


def compile_(model, name: str) -> None:
    # GPT2CausalLM.compile's default weighted_metrics="auto" adds a metric that a plain
    # compile does not: both get the same explicit list.
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=name == "gpt2_causal_lm")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, metrics=["sparse_categorical_accuracy"],
                  weighted_metrics=[])


def stage_weights(model) -> dict[int, list]:
    """This rank's layers' weights keyed by the layer's position in the serial weights order."""
    order = {name: k for k, name in enumerate(model.plan.graph.layer_order)}
    return {order[layer.name]: layer.get_weights() for layer in held_layers(model.stage_model)
            if layer.name in order}


def _saved_optimizer_diff(path: Path, serial_optimizer: list[np.ndarray]) -> float:
    """Largest difference between the optimizer variables in the file and the serial
    model's (Adam's moments of every weight, the tied one once), in the file's order."""
    with zipfile.ZipFile(path) as archive:
        with h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as f:
            group = f["optimizer"]["vars"]
            saved = [np.asarray(group[str(k)]) for k in range(len(group))]
    if len(saved) != len(serial_optimizer):
        return float("inf")
    return _job.max_abs_diff(serial_optimizer, saved)


def _dataset(name: str):
    x, y = data(name, seed=3)
    return x, tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def serial_reference(name: str) -> dict:
    """Plain Keras from the seed-5 weights: History, predict, each leaf layer's initial and
    final weights, the optimizer's variables."""
    x, ds = _dataset(name)
    serial = build(name)
    initial = [layer.get_weights() for layer in leaf_layers(serial)]
    compile_(serial, name)
    history = serial.fit(ds, epochs=EPOCHS, verbose=0).history
    return {"initial": initial, "history": history, "predict": serial.predict(x, batch_size=BATCH, verbose=0),
            "layers": [layer.get_weights() for layer in leaf_layers(serial)],
            "optimizer": [np.asarray(v.numpy()) for v in serial.optimizer.variables]}


def run_case(name: str, tmp: Path, ref: dict | None) -> dict:
    """The pipelined run; the master (``ref`` not None) compares with the serial reference."""
    x, ds = _dataset(name)
    serial = build(name)  # on every rank: the same objects, hence the same names
    initial_diff = None
    if ref is not None:
        initial_diff = _job.max_abs_diff(ref["initial"], [layer.get_weights() for layer in leaf_layers(serial)])
    model = tnt.Model(build(name), parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                      num_pipeline_stages=2, num_micro_batches=4)
    compile_(model, name)
    history = model.fit(ds, epochs=EPOCHS, verbose=0).history
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    mine = stage_weights(model)
    params = sum(int(np.prod(w.shape)) for w in model.stage_model.weights)
    gathered = tnt_comm.allgather_object({"weights": mine, "params": params,
                                          "replicas": list(model.plan.stages[tnt.get_rank()].replicas)})
    out = None
    if ref is not None:
        total = sum(int(np.prod(w.shape)) for w in serial.weights)
        diff = 0.0
        copies = {}
        for g in gathered:
            for k, ws in g["weights"].items():
                diff = max(diff, _job.max_abs_diff(ref["layers"][k], ws))
                copies.setdefault(k, []).append(ws)
        tied_copies = max(_job.max_abs_diff(c[0], c[1]) if len(c) > 1 else 0.0 for c in copies.values())
        out = {
            "initial_diff": initial_diff,
            "history_diff": _job.history_diff(ref["history"], history),
            "history_keys": [sorted(ref["history"]), sorted(history)],
            "weight_diff": diff,
            "layers_seen": [sorted(copies), len(ref["layers"])],
            "predict_diff": _job.max_abs_diff(ref["predict"], predicted),
            "stage_shares": [g["params"] / total for g in gathered],
            "replicas": [g["replicas"] for g in gathered],
            "tied_copies_diff": tied_copies,
        }
    if name == "gpt2_causal_lm":
        path = tmp / "causal_lm.keras"
        model.save(path)
        if out is not None:
            plain = keras.saving.load_model(path)
            out["saved_weights"] = [len(plain.get_weights()), len(serial.get_weights())]
            out["saved_predict_diff"] = _job.max_abs_diff(ref["predict"],
                                                          plain.predict(x, batch_size=BATCH, verbose=0))
            out["saved_optimizer_diff"] = _saved_optimizer_diff(path, ref["optimizer"])
        # The task's file into 2 stages again: GPT2CausalLM.__init__ compiles itself (a
        # fresh Adam), inside the deferred scope that loading builds the model in.
        loaded = tnt.models.load_model(path, parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                                       num_pipeline_stages=2, num_micro_batches=4)
        reloaded = loaded.predict(x, batch_size=BATCH, verbose=0)
        if out is not None:
            out["loaded_into_stages_predict_diff"] = _job.max_abs_diff(ref["predict"], reloaded)
    return out or {}


def run_all(names: list[str]) -> dict:
    tmp = Path(tnt_comm.broadcast_object(tempfile.mkdtemp(prefix="tnt_real_pipe_"), 0))
    refs = _job.timed("serial references", lambda: _serial_refs.shared(names, serial_reference))
    return {name: _job.timed(name, lambda name=name: run_case(name, tmp, refs.get(name))) for name in names}


def main() -> None:
    out = _job.out_path()
    _job.write(out, {"ranks": tnt.get_size(), "cases": run_all(_job.only(MODELS))})


if __name__ == "__main__":
    main()
