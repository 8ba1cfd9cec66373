"""Real models, TENSOR strategy (t = 2): keras-hub Transformers built from constructor
arguments (the builders of jobs/real_models.py) train on 2 ranks as in serial Keras.

Each case trains serially (plain Keras; the references spread over the ranks,
jobs/_serial_refs.py) and with tnt.Model(TENSOR, tensor_parallel_size=2) from the same
initial weights on the same global batches, with Adam, and records: the largest
differences to serial (History, gathered weights, predict), History keys, the share of
the serial weights each rank holds, the plan's splits. Llama (4 query, 2 key/value
heads) trains with the automatic plan splitting its grouped-query attention by heads
(the plan keras-hub's own LayoutMap gives too); Gemma (4 query, 2 key/value heads,
heads-first kernels) likewise, its gated FFN column/row.
Further cases: ranks whose Keras auto-generated names differ (rank 0 built other
models first) train correctly; ranks that built different models all fail together with
the same error (no hang).
"""

from __future__ import annotations

import os
import tempfile

import _job
import _serial_refs
import keras
import numpy as np
import real_models as rm
import tensorflow as tf

import tarantella as tnt
import tnt_comm

TENSOR = tnt.ParallelStrategy.TENSOR


def _local_share(model) -> float:
    """Weights this rank holds (its local model's variables) over the serial model's."""
    local = sum(int(np.prod(v.shape)) for v in model.local_model.weights)
    serial = sum(int(np.prod(v.shape)) for v in model._serial.weights)
    return local / serial


def serial_reference(case: str) -> dict:
    """Plain Keras from the seed-5 weights on the case's batches: History, final weights, predict."""
    build, x, y, compile_ = SETUPS[case]()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(rm.BATCH)
    initial = build(5).get_weights()
    serial = build(5)
    serial.set_weights(initial)
    compile_(serial)
    history = serial.fit(ds, epochs=rm.EPOCHS, verbose=0).history
    return {"initial": initial, "history": history, "weights": serial.get_weights(),
            "predict": serial.predict(x, batch_size=rm.BATCH, verbose=0)}


def _train(case: str, ref: dict | None, plan_edit=None, save=False) -> dict:
    """TENSOR t=2 from the seed-5 weights; the master (``ref`` not None) records the
    differences to the serial reference."""
    build, x, y, compile_ = SETUPS[case]()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(rm.BATCH)
    initial = build(5).get_weights()
    keras_model = build(100 + tnt.get_rank())  # rank 0's weights must win (set_weights below)
    plan = None
    if plan_edit is not None:
        plan = plan_edit(tnt.tensor_parallel.plan(keras_model, tensor_parallel_size=2))
    model = tnt.Model(keras_model, parallel_strategy=TENSOR, tensor_parallel_size=2, tensor_parallel_plan=plan)
    model.set_weights(initial)
    compile_(model)
    history = model.fit(ds, epochs=rm.EPOCHS, verbose=0).history
    weights = model.get_weights()
    predicted = model.predict(x, batch_size=rm.BATCH, verbose=0)
    shares = tnt_comm.allgather_object(_local_share(model))
    saved_predict = None
    if save:
        path = tnt_comm.broadcast_object(os.path.join(tempfile.mkdtemp(), "m.keras") if tnt.is_master_rank() else None, 0)
        model.save(path)
        if tnt.is_master_rank():
            saved_predict = keras.saving.load_model(path, compile=False).predict(x, batch_size=rm.BATCH, verbose=0)
        try:
            model.load_weights(path)
            load_error = "no error"
        except tnt.tensor_parallel.TensorParallelError as err:
            load_error = str(err)
        load_errors = tnt_comm.allgather_object(load_error)
    if ref is None:
        return {}
    out = {
        "initial_diff": _job.max_abs_diff(ref["initial"], initial),
        # over the keys both have (History keys are compared by the test, separately)
        "history_diff": _job.history_diff({k: v for k, v in ref["history"].items() if k in history},
                                          {k: v for k, v in history.items() if k in ref["history"]}),
        "weight_diff": _job.max_abs_diff(ref["weights"], weights),
        "predict_diff": _job.max_abs_diff(ref["predict"], predicted),
        "history_keys": [sorted(ref["history"]), sorted(history)],
        "local_shares": shares,
        "splits": model.plan.split_layers(),
        "layer_names": [layer.name for layer in keras_model.layers],
    }
    if saved_predict is not None:
        out["saved_predict_diff"] = _job.max_abs_diff(ref["predict"], saved_predict)
        out["load_errors"] = load_errors
    return out


def _hub_setup(name: str) -> tuple:
    x, y = rm.data(name, seed=3)
    return lambda seed: rm.build(name, seed), x, y, lambda m: rm.compile_(m, name)


def gpt2(ref: dict | None) -> dict:
    return _train("gpt2", ref, save=True)


def bert(ref: dict | None) -> dict:
    return _train("bert", ref)


def gpt2_causal_lm_vocab(ref: dict | None) -> dict:
    """The tied token embedding split by vocabulary (an edited plan: it is below
    min_split_params): its lookup and its reverse projection (the logits) on shards."""
    return _train("gpt2_causal_lm_vocab", ref, plan_edit=lambda p: p.split("token_embedding", "vocab"))


GQA_VOCAB = 64


def _llama_gqa(seed: int) -> keras.Model:
    """LlamaBackbone (vocabulary 64, 2 blocks, 4 query and 2 key/value heads, hidden 16,
    FFN 32) under the pooled 3-way head: its grouped-query attention splits by heads."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=GQA_VOCAB, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
    inputs = {n: keras.Input((rm.LENGTH,), dtype="int32", name=n) for n in ("token_ids", "padding_mask")}
    return rm._head(backbone, inputs)


def _padded_tokens() -> tuple[dict, np.ndarray]:
    """Token ids of GQA_VOCAB with some padded sequences (the padding mask meets the causal one)."""
    rng = np.random.default_rng(4)
    ids = rng.integers(1, GQA_VOCAB, size=(rm.SAMPLES, rm.LENGTH)).astype("int32")
    mask = np.ones_like(ids)
    mask[::3, -3:] = 0
    return {"token_ids": ids * mask, "padding_mask": mask}, (ids[:, 0] % 3).astype("int32")


def llama_gqa(ref: dict | None) -> dict:
    """The automatic plan (min_split_params lowered so the small token embedding splits by
    vocabulary too; the default plan is checked in test_tensor_parallel_plan.py): both
    decoder blocks 'block' (grouped-query attention by heads, gated FFN column/row); padded
    sequences (the padding mask meets the causal one); the saved file in plain Keras.
    keras-hub's own LayoutMap (LlamaBackbone.get_layout_map, data axis "batch") gives the
    same plan (checked, not trained again: a plan trains the same whatever made it)."""
    import keras_hub
    out = _train("llama_gqa", ref,
                 lambda p: tnt.tensor_parallel.plan(p.model, tensor_parallel_size=2, min_split_params=1024), save=True)
    if out:
        mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
        layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
        out["layout_map_splits"] = tnt.tensor_parallel.from_layout_map(layout_map, _llama_gqa(5), 2).split_layers()
    return out


def _gemma_gqa(seed: int) -> keras.Model:
    """GemmaBackbone (vocabulary 64, 2 blocks, 4 query and 2 key/value heads of size 8,
    hidden 32, FFN 64: two gating layers of 32) under the pooled 3-way head."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=GQA_VOCAB, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=2, head_dim=8, hidden_dim=32, intermediate_dim=64)
    inputs = {n: keras.Input((rm.LENGTH,), dtype="int32", name=n) for n in ("token_ids", "padding_mask")}
    return rm._head(backbone, inputs)


def gemma_gqa(ref: dict | None) -> dict:
    """The automatic plan (min_split_params lowered as for Llama): both Gemma decoder blocks
    'block' (heads-first grouped-query attention by query and key/value heads, gating layers
    column, ffw_linear row), the tied token embedding by vocabulary; padded sequences.
    keras-hub's own LayoutMap (GemmaBackbone.get_layout_map) is checked in
    test_tensor_parallel_plan.py (no launch)."""
    return _train("gemma_gqa", ref,
                  lambda p: tnt.tensor_parallel.plan(p.model, tensor_parallel_size=2, min_split_params=1024))


def _mlp(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(x)
    h = keras.layers.Dense(6)(h)
    return keras.Model(x, keras.layers.Dense(3, activation="softmax")(h))


def _mlp_setup() -> tuple:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(rm.SAMPLES, 6)).astype("float32")
    y = rng.integers(0, 3, size=rm.SAMPLES).astype("int32")

    def compile_(m):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    return _mlp, x, y, compile_


def names_differ(ref: dict | None) -> dict:
    """Rank 0 builds other Keras models before the one it wraps: auto names differ by rank."""
    if tnt.is_master_rank():
        for _ in range(3):
            _mlp(0)
    names = tnt_comm.allgather_object([layer.name for layer in _mlp(0).layers])
    out = _train("names_differ", ref)
    if out:
        out["names_by_rank"] = names
    return out


def plan_mismatch(ref: dict | None) -> dict:
    """Rank 1 builds another model (wider hidden layer): every rank raises the same error."""
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    h = keras.layers.Dense(8 if tnt.get_rank() == 0 else 12, activation="relu")(x)
    keras_model = keras.Model(x, keras.layers.Dense(6)(h))
    try:
        tnt.Model(keras_model, parallel_strategy=TENSOR, tensor_parallel_size=2)
        outcome = "no error"
    except tnt.tensor_parallel.TensorParallelError as err:
        outcome = str(err)
    return {"errors": tnt_comm.allgather_object(outcome)}


CASES = {"gpt2": gpt2, "bert": bert, "gpt2_causal_lm_vocab": gpt2_causal_lm_vocab, "llama_gqa": llama_gqa,
         "gemma_gqa": gemma_gqa, "names_differ": names_differ,
         "plan_mismatch": plan_mismatch}


#: case -> () -> (build(seed), x, y, compile_(model)): the cases trained against serial Keras
SETUPS = {"gpt2": lambda: _hub_setup("gpt2"), "bert": lambda: _hub_setup("bert"),
          "gpt2_causal_lm_vocab": lambda: _hub_setup("gpt2_causal_lm"),
          "llama_gqa": lambda: (_llama_gqa, *_padded_tokens(), lambda m: rm.compile_(m, "llama")),
          "gemma_gqa": lambda: (_gemma_gqa, *_padded_tokens(), lambda m: rm.compile_(m, "gemma")),
          "names_differ": _mlp_setup}


def run_all(names: list[str]) -> dict:
    refs = _job.timed("serial references", lambda: _serial_refs.shared([n for n in names if n in SETUPS],
                                                                       serial_reference))
    return {name: _job.timed(name, lambda name=name: CASES[name](refs.get(name))) for name in names}


def main() -> None:
    out = _job.out_path()
    _job.write(out, {"ranks": tnt.get_size(), "cases": run_all(_job.only(CASES))})


if __name__ == "__main__":
    main()
