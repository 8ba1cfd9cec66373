"""Failure job: a 2-rank fit in which one rank fails mid-epoch in the way --scenario names.

Rank 1 (rank 0 for `skip_collective`) fails at epoch 1, batch 5, after writing the time
of the failure to <dir>/failed_at; rank 0 writes <dir>/training when that point is
reached (the test sends Ctrl+C then). The test asserts how and how fast the job ends.

Scenarios: raise (uncaught exception), sigkill, sys_exit (sys.exit(3)), os_exit
(os._exit(4)), return_early (rank 1 stops training and its script returns),
sleep_in_step (rank 1 blocks inside a training step), skip_collective (rank 0 runs one
extra collective the other rank does not), catch_continue (a callback raises on rank 0, the
script catches it and evaluates while rank 1 is still inside fit), sigint (no failure:
trains until Ctrl+C).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import _job  # noqa: F401  (determinism and threads, set on import)
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

FAIL_AT = (1, 5)  # (epoch, batch)
SLEEP_S = 120.0
STATE = {"sleep": False}


def _maybe_sleep(x):
    if STATE["sleep"]:
        time.sleep(SLEEP_S)  # inside the step's graph, before its allreduce
    return x


class StepHook(keras.layers.Layer):
    """Identity layer that runs Python inside the compiled training step."""

    def call(self, x):
        y = tf.numpy_function(_maybe_sleep, [x], x.dtype, stateful=True)
        y.set_shape(x.shape)
        return x + tf.stop_gradient(y - x)


class Inject(keras.callbacks.Callback):
    def __init__(self, scenario: str, folder: Path) -> None:
        super().__init__()
        self.scenario = scenario
        self.folder = folder
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def _mark(self, name: str) -> None:
        (self.folder / name).write_text(repr(time.time()))

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) != FAIL_AT:
            return
        rank, s = tnt.get_rank(), self.scenario
        if rank == 0:
            self._mark("training")
        if s == "sigint" or rank != (0 if s in ("skip_collective", "catch_continue") else 1):
            return
        self._mark("failed_at")
        if s in ("raise", "catch_continue"):
            raise RuntimeError(f"injected failure on rank {rank} at epoch {self.epoch}, batch {batch}")
        if s == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if s == "sys_exit":
            sys.exit(3)
        if s == "os_exit":
            os._exit(4)
        if s == "return_early":
            self.model.stop_training = True
        if s == "sleep_in_step":
            STATE["sleep"] = True
        if s == "skip_collective":
            tnt_comm.allreduce(np.ones(4, np.float32))  # e.g. a master-only "global" metric


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--scenario", required=True)
    args = parser.parse_args()
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype("float32")
    y = rng.integers(0, 4, size=512).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    model = tnt.Model(keras.Sequential([
        keras.Input((16,)), StepHook(), keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(4, activation="softmax")]))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    epochs = 10_000 if args.scenario == "sigint" else 3
    try:
        model.fit(data, epochs=epochs, verbose=0, callbacks=[Inject(args.scenario, args.out.parent)])
    except RuntimeError:
        if args.scenario != "catch_continue":
            raise
        model.evaluate(data, verbose=0)  # out of step: rank 1 is still training
    if tnt.is_master_rank():
        args.out.write_text("finished")


if __name__ == "__main__":
    main()
