"""The timeline pictures of docs/timeline.md and docs/pipelining.md, from real runs.

    tarantella -n 2 -- tools/timeline/pictures.py [--out docs/img]

One model (a dense stack, 8 layers of 256, a trainable bias in front so that both stages
do the same work; B = 2048) trained for 3 steps under data parallelism and as 2 pipeline
stages with m = 8 under GPipe, 1F1B and ZB-H1, each inside ``tnt.timeline``; the master
renders the second step of each trace (render.py) and keeps the traces beside the PNGs.
The fusion threshold is set to 256 KiB so that data parallelism sends several buckets.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TNT_FUSION_THRESHOLD", "256")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import tarantella as tnt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from render import render  # noqa: E402

WIDTH, DEPTH, B, M, STEPS = 256, 8, 2048, 8, 3


class Bias(keras.layers.Layer):
    def build(self, input_shape):
        self.b = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="b")

    def call(self, x):
        return x + self.b


def stack() -> keras.Model:
    keras.utils.set_random_seed(0)
    x = inp = keras.Input((WIDTH,))
    x = Bias()(x)
    for _ in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="relu")(x)
    return keras.Model(inp, keras.layers.Dense(10, activation="softmax")(x))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="docs/img")
    out = Path(p.parse_args().out)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B * STEPS, WIDTH)).astype("float32")
    y = rng.integers(0, 10, B * STEPS).astype("int32")
    runs = {"data_parallel": {}}
    runs.update({s: dict(parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_pipeline_stages=2,
                         num_micro_batches=M, pipeline_schedule=s) for s in ("gpipe", "1f1b", "zb-h1")})
    if tnt.is_master_rank():
        out.mkdir(parents=True, exist_ok=True)
    for name, options in runs.items():
        model = tnt.Model(stack(), **options)
        model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
        model.fit(x[:B], y[:B], batch_size=B, verbose=0)  # traced before the timeline: steps only
        path = out / f"timeline_{name.replace('-', '_')}.json"
        with tnt.timeline(str(path)):
            if name == "data_parallel":  # traced inside: the buckets are recorded
                model = tnt.Model(stack(), **options)
                model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
            model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
        if tnt.is_master_rank():
            from tarantella.timeline import load

            title = (f"{name}: 2 ranks, dense 8 x {WIDTH}, B = {B}" + (f", m = {M}" if name != "data_parallel" else "")
                     + ", step 2 of 3")
            render(load(str(path)), str(path.with_suffix(".png")), title, step=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
