"""ZB-H1's pass costs on one stage of pipeline.py's schedule model (Note [Split backward]).

    python benchmarks/zb_passes.py [--reps 10]

One stage of ``pipeline.py``'s stack (4 Dense 512 x 512 + ReLU, a watched input) at its
micro-batch (B = 8192, m = 8: 1024 rows), one intra-op thread. Per micro-batch, median
CPU time (not wall: the machine may be loaded) of the forward F, the joint backward 1F1B
runs, and B and W two ways: two gradients of one persistent tape (before the cut) and the
cut backward ZB-H1 runs now. Prints W / joint and (B + W) / joint for both, and whether
the cut's gradients are bitwise the joint backward's. Single process, no ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
import tensorflow as tf

from tarantella.pipelining._split_backward import SplitBackward

WIDTH, LAYERS, ROWS = 512, 4, 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=10)
    reps = parser.parse_args().reps
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    x = inp = keras.Input((WIDTH,))
    for _ in range(LAYERS):
        x = keras.layers.Dense(WIDTH, activation="relu")(x)
    model = keras.Model(inp, x)
    forward = tf.function(lambda inputs: keras.tree.flatten(model(inputs, training=True)), autograph=False)
    xin, dy = tf.random.normal((ROWS, WIDTH)), tf.random.normal((ROWS, WIDTH))
    variables = model.trainable_variables
    split = SplitBackward()

    def cpu(fn):
        t0 = time.process_time()
        out = fn()
        return out, time.process_time() - t0

    def joint():
        with tf.GradientTape() as tape:
            tape.watch(xin)
            outs = forward([xin])
        return cpu(lambda: tape.gradient(outs, [xin, *variables], output_gradients=[dy]))

    def two_tape_gradients():
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(xin)
            outs = forward([xin])
        gi, b = cpu(lambda: tape.gradient(outs, [xin], output_gradients=[dy]))
        gw, w = cpu(lambda: tape.gradient(outs, variables, output_gradients=[dy]))
        return gi + gw, b, w

    def cut():
        record = split.forward(forward, ([xin],), [0])
        gi, b = cpu(lambda: split.backward_inputs(record, [dy]))
        gw, w = cpu(lambda: split.backward_weights(record))
        return gi + [gw[p] for p in record.positions(variables)], b, w

    ref = joint()[0]
    bitwise = all(np.array_equal(a, b) for a, b in zip(ref, cut()[0]))
    times: dict[str, list[float]] = {k: [] for k in ("F", "joint", "tape B", "tape W", "cut B", "cut W")}
    for _ in range(reps):  # side by side in each repetition
        times["F"].append(cpu(lambda: forward([xin]))[1])
        times["joint"].append(joint()[1])
        _, b, w = two_tape_gradients()
        times["tape B"].append(b)
        times["tape W"].append(w)
        _, b, w = cut()
        times["cut B"].append(b)
        times["cut W"].append(w)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(", ".join(f"{k} {v:.1f} ms" for k, v in med.items()) + f" (median CPU time of {reps})")
    for how in ("tape", "cut"):
        print(f"{how}: W / joint {med[f'{how} W'] / med['joint']:.2f}, "
              f"(B + W) / joint {(med[f'{how} B'] + med[f'{how} W']) / med['joint']:.2f}")
    print(f"cut gradients bitwise the joint backward's: {bitwise}")


if __name__ == "__main__":
    main()
