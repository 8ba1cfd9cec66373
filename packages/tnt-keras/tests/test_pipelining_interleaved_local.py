"""The interleaved schedule run in one process (stages as threads) against 1F1B and serial
Keras: the same executor and end-of-step code as on p ranks, several chunks per stage.

A last batch of 3 rows runs as 3 micro-batches, no multiple of p = 2 (all forwards first).
The skip model's chunk 0 output is read by chunk 2, which stage 0 holds too: that message
is handed over inside the stage.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tarantella as tnt
from tarantella.pipelining import LocalPipeline, PipelineError

tf.config.experimental.enable_op_determinism()

LOSS = "sparse_categorical_crossentropy"
N, B = 49, 23  # batches of 23, 23, 3


def mlp() -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((10,)),
        keras.layers.Dense(16, activation="tanh", name="d0"),
        keras.layers.Dense(16, activation="relu", name="d1", kernel_regularizer=keras.regularizers.L2(0.01)),
        keras.layers.Dense(12, activation="tanh", name="d2"),
        keras.layers.Dense(3, activation="softmax", name="d3"),
    ], name="mlp")


def skip_model() -> keras.Model:
    keras.utils.set_random_seed(2)
    a = keras.Input((10,), name="a")
    x0 = keras.layers.Dense(8, activation="relu", name="s0")(a)
    x1 = keras.layers.Dense(8, activation="tanh", name="s1")(x0)
    x2 = keras.layers.Dense(8, activation="relu", name="s2")(x1)
    x3 = keras.layers.Concatenate(name="cat")([x2, x0])
    return keras.Model(a, keras.layers.Dense(3, activation="softmax", name="s3")(x3), name="skip")


def data():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, N).astype("int32")
    return rng.normal(size=(N, 10)).astype("float32") + y[:, None] * 0.3, y


def serial(make, x, y):
    model = make()
    model.compile(keras.optimizers.Adam(0.01), LOSS, metrics=["accuracy"])
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    return model


def pipelined(make, x, y, schedule, split_after, **kwargs):
    model = make()
    plan = tnt.pipelining.plan(model, split_after=split_after)
    pipe = LocalPipeline(model, num_micro_batches=4, pipeline_schedule=schedule, pipeline_plan=plan, **kwargs)
    pipe.compile(keras.optimizers.Adam(0.01), LOSS, metrics=["accuracy"])
    for _ in range(2):
        pipe.reset_metrics()
        for lo in range(0, N, B):
            logs = pipe.train_step(tf.constant(x[lo:lo + B]), tf.constant(y[lo:lo + B]))
    return pipe, logs


@pytest.mark.parametrize("make,chunks,stages", [
    (mlp, ["d0", "d1", "d2"], ["d1"]),
    (skip_model, ["s0", "s1", "cat"], ["s1"]),
])
def test_interleaved_is_1f1b_and_serial(make, chunks, stages):
    x, y = data()
    ref = serial(make, x, y)
    inter, logs_i = pipelined(make, x, y, "interleaved", chunks, virtual_stages=2)
    one, logs_1 = pipelined(make, x, y, "1f1b", stages)
    assert [len(st.chunks) for st in inter.stages] == [2, 2]
    assert [[c.index for c in st.chunks] for st in inter.stages] == [[0, 2], [1, 3]]
    wi, w1, ws = inter.get_weights(), one.get_weights(), ref.get_weights()
    assert all(np.array_equal(u, v) for u, v in zip(wi, w1)), "interleaved differs from 1f1b"
    assert logs_i == logs_1
    assert max(float(np.max(np.abs(u - v))) for u, v in zip(wi, ws)) <= 5e-6
    # Stage 0 holds (v + 1) p - 1 = 5 chunk activation sets of the 4-micro-batch steps (of 8),
    # all v m = 6 of the last batch's 3 micro-batches (all forwards first); stage 1: 2 (p - 1) ... + 1.
    assert [st.peak_live for st in inter.stages] == [6, 6]


def test_errors_name_the_fix():
    with pytest.raises(PipelineError, match=r"multiple of num_pipeline_stages=2.*got 3; pass num_micro_batches=2 or 4"):
        LocalPipeline(mlp(), 2, num_micro_batches=3, pipeline_schedule="interleaved", virtual_stages=2)
    with pytest.raises(PipelineError, match=r"2 x 3 = 6 chunks, but model 'mlp' has only 4 layer calls; "
                                            r"pass virtual_stages=2 or less"):
        LocalPipeline(mlp(), 2, num_micro_batches=4, pipeline_schedule="interleaved", virtual_stages=3)
    with pytest.raises(PipelineError, match=r"virtual_stages=2 needs pipeline_schedule='interleaved'"):
        LocalPipeline(mlp(), 2, num_micro_batches=4, pipeline_schedule="1f1b", virtual_stages=2)


@pytest.mark.parametrize("options,message", [
    ({"parallel_strategy": tnt.ParallelStrategy.ALL, "pipeline_schedule": "interleaved"},
     r"runs with ParallelStrategy.PIPELINING only .*use ParallelStrategy.PIPELINING, or pipeline_schedule='1f1b'"),
    ({"pipeline_schedule": "interleaved", "num_micro_batches": 3},
     r"multiple of num_pipeline_stages=2.*got 3; pass num_micro_batches=2 or 4"),
    ({"pipeline_schedule": "interleaved", "virtual_stages": 3}, r"2 x 3 = 6 chunks.*only 4 layer calls"),
    ({"pipeline_schedule": "gpipe", "virtual_stages": 2}, r"virtual_stages=2 needs pipeline_schedule='interleaved'"),
])
def test_tnt_model_refuses_on_one_rank_as_on_many(options, message):
    # Checked before the one-rank shortcut (the data-parallel wrapper): a script fails alike
    # under python and under the launcher.
    options = {"parallel_strategy": tnt.ParallelStrategy.PIPELINING, "num_pipeline_stages": 2, **options}
    with pytest.raises(PipelineError, match=message):
        tnt.Model(mlp(), **options)
