"""A stage that fails mid-training: the whole job must end at once, non-zero.

Stage 1 raises from a callback after its second step; stage 0 is then waiting for
stage 1's gradients. The uncaught exception must stop every rank (tnt_comm aborts the
job) instead of leaving stage 0 waiting until the stall timeout. Before raising, stage 1
writes the time to ``--out`` so the test can measure how long the job took to end.
"""

from __future__ import annotations

import time

import _job
import keras
import numpy as np

import tarantella as tnt


class FailOnStage1(keras.callbacks.Callback):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1 and self.model.stage == 1:
            self.out.write_text(f"{time.time()}")
            raise RuntimeError("boom on stage 1")


def main() -> None:
    out = _job.out_path()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    model = tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_pipeline_stages=2,
                      num_micro_batches=2)
    model.compile("sgd", "mse")
    x = np.ones((64, 8), "float32")
    model.fit(x, np.ones((64, 2), "float32"), batch_size=8, epochs=3, verbose=0, callbacks=[FailOnStage1(out)])


if __name__ == "__main__":
    main()
