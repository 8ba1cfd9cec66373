"""remat="stages" (Note [Stage recomputation]) in one process, stages as threads.

A stage that recomputes its forward in the backward pass must train bitwise as the stage
that kept its activations — the same dropout masks, batch-normalisation statistics updated
once per micro-batch, metrics counted once — under every schedule, and must keep fewer
activations alive. Models built under ``keras.RematScope`` train as serial Keras.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tarantella.pipelining import LocalPipeline, PipelineError

tf.config.experimental.enable_op_determinism()

N, B, M, P = 48, 16, 4, 2
LOSS = "sparse_categorical_crossentropy"


def dropout_bn_model() -> keras.Model:
    """Dropout (a seed generator), batch normalisation (moving statistics) and a second
    output whose loss Keras tracks as a metric of its own, on every stage."""
    keras.utils.set_random_seed(3)
    x = inp = keras.Input((10,))
    for width in (24, 24, 16):
        x = keras.layers.Dense(width, activation="relu")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Dropout(0.3)(x)
    main = keras.layers.Dense(3, activation="softmax", name="main")(x)
    aux = keras.layers.Dense(1, name="aux")(x)
    return keras.Model(inp, [main, aux], name="dropout_bn")


def data():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, N).astype("int32")
    x = rng.normal(size=(N, 10)).astype("float32") + y[:, None] * 0.3
    return x, (y, rng.normal(size=(N, 1)).astype("float32"))


def train(remat, schedule: str, epochs: int = 1):
    x, (y, aux) = data()
    pipe = LocalPipeline(dropout_bn_model(), P, num_micro_batches=M, pipeline_schedule=schedule, remat=remat)
    pipe.compile(keras.optimizers.Adam(0.01), [LOSS, "mse"], metrics=[["accuracy"], []])
    history: dict[str, list] = {}
    for _ in range(epochs):
        pipe.reset_metrics()
        for lo in range(0, N, B):
            logs = pipe.train_step(tf.constant(x[lo:lo + B]),
                                   (tf.constant(y[lo:lo + B]), tf.constant(aux[lo:lo + B])))
        for k, v in logs.items():
            history.setdefault(k, []).append(float(v))
    variables = [np.asarray(v) for st in pipe.stages for v in st.model.variables]
    return pipe, history, variables


@functools.cache
def trained(remat, schedule: str):
    return train(remat, schedule)


@pytest.fixture(scope="module", params=["1f1b", "gpipe", "zb-h1"])
def runs(request):
    return request.param, trained(None, request.param), trained("stages", request.param)


def test_zb_h1_cut_backward_keeps_dropout_and_batch_norm_bitwise_as_1f1b():
    """ZB-H1's B and W (Note [Split backward]) from the forward 1F1B's tape runs: the same
    masks, statistics and weights, with and without recomputation."""
    for remat in (None, "stages"):
        zb, zb_hist, zb_vars = trained(remat, "zb-h1")
        _, hist, variables = trained(remat, "1f1b")
        assert zb_hist == hist
        assert all(np.array_equal(a, b) for a, b in zip(zb_vars, variables)), remat
        assert all(c._splitter is not None and c.split_fallback is None
                   for st in zb.stages for c in st.executor.chunks.values())


def test_recomputing_stages_train_bitwise_as_keeping_activations(runs):
    schedule, (_, kept_hist, kept_vars), (_, remat_hist, remat_vars) = runs
    assert sorted(remat_hist) == sorted(kept_hist)
    assert len(kept_hist) >= 4  # loss, the two outputs' losses, accuracy
    assert remat_hist == kept_hist, schedule
    # trainable weights, moving statistics and seed generator states alike
    assert len(remat_vars) == len(kept_vars)
    assert all(np.array_equal(a, b) for a, b in zip(remat_vars, kept_vars)), schedule


def test_dropout_is_on_so_the_masks_mattered(runs):
    # A re-run that drew new masks would have changed the weights: the comparison above
    # can fail only if dropout draws differ between steps (the seed state moves).
    _, (pipe, _, _), _ = runs
    seeds = [np.asarray(v) for st in pipe.stages for v in st.model.non_trainable_variables
             if "seed_generator" in v.path]
    assert seeds and all(np.any(s != 0) for s in seeds)


def test_recomputing_stages_keep_one_set_of_activations_at_a_time(runs):
    schedule, (kept, _, _), (remat, _, _) = runs
    # in flight per stage: GPipe all m; 1F1B p - s; ZB-H1 also those whose W it defers
    in_flight = {"gpipe": [M, M], "1f1b": [2, 1], "zb-h1": [2, 2]}[schedule]
    assert [st.peak_live for st in kept.stages] == in_flight
    assert [st.peak_live for st in remat.stages] == in_flight
    assert [st.peak_taped for st in kept.stages] == in_flight  # every one in flight holds a tape
    # recomputing: one tape at a time (ZB-H1: the last stage holds a B's tape until its W)
    assert [st.peak_taped for st in remat.stages] == {"zb-h1": [1, 2]}.get(schedule, [1, 1])


def test_unknown_remat_names_the_choices():
    with pytest.raises(PipelineError, match="remat='stages'"):
        LocalPipeline(dropout_bn_model(), 2, remat="layers")


def test_a_model_built_under_keras_remat_scope_pipelines_as_serial():
    # mode="activations": Keras 3.15's "full"/"list_of_layers" fail in serial Keras' own
    # fit on TensorFlow (tf.recompute_grad takes no keyword arguments in a tf.function).
    def make() -> keras.Model:
        keras.utils.set_random_seed(4)
        x = inp = keras.Input((10,))
        with keras.RematScope(mode="activations"):
            for width in (32, 32, 16):
                x = keras.layers.Dense(width, activation="tanh")(x)
            out = keras.layers.Dense(3, activation="softmax")(x)
        return keras.Model(inp, out)

    x, (y, _) = data()
    ref = make()
    ref.compile(keras.optimizers.Adam(0.01), LOSS)
    ref_hist = ref.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    pipe = LocalPipeline(make(), 2, num_micro_batches=M, remat="stages")
    pipe.compile(keras.optimizers.Adam(0.01), LOSS)
    for _ in range(2):
        pipe.reset_metrics()
        for lo in range(0, N, B):
            logs = pipe.train_step(tf.constant(x[lo:lo + B]), tf.constant(y[lo:lo + B]))
    assert abs(float(logs["loss"]) - ref_hist["loss"][-1]) <= 2e-6
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(pipe.get_weights(), ref.get_weights()))
    assert diff <= 5e-6
