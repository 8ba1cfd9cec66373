"""ALL on 8 ranks: 2 pipeline stages of 2-rank tensor groups x 2 replicas at sharding=2 (Adam)
against serial Keras in the same job: History and weights, replicas of each stage's shard
bitwise alike with partitioned optimizer slots, the saved file read by serial Keras.
Rank 0 writes the JSON that tests/large/test_sharded_all_8ranks.py checks."""

from __future__ import annotations

import hashlib

import _job
import keras
import numpy as np

import tarantella as tnt
import tnt_comm


def staged(seed: int = 3) -> keras.Model:
    """Stage 0: up1/down1, stage 1: up2/act/down2/head; each Dense pair column/row split."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((10,))
    h = keras.layers.Dense(16, activation="relu", name="up1")(x)
    h = keras.layers.Dense(12, name="down1")(h)
    h = tnt.keras.layers.SplitLayer(name="split")(h)
    h = keras.layers.Dense(24, name="up2")(h)
    h = keras.layers.Activation("tanh", name="act")(h)
    h = keras.layers.Dense(8, activation="relu", name="down2")(h)
    y = keras.layers.Dense(4, name="head")(h)
    return keras.Model(x, y, name="staged")


def main() -> None:
    out = _job.out_path()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(36, 10)).astype("float32")
    y = rng.normal(size=(36, 4)).astype("float32")
    tm = tnt.Model(staged(), parallel_strategy=tnt.ParallelStrategy.ALL, num_pipeline_stages=2,
                   tensor_parallel_size=2, num_micro_batches=2, sharding=2)
    tm.compile(keras.optimizers.Adam(0.01), "mse")
    history = tm.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    serial = staged()
    serial.compile(keras.optimizers.Adam(0.01), "mse")
    serial_history = serial.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    weights = tm.get_weights()
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(v.numpy()).tobytes() for v in tm.stage_model.weights))
    slots = sum(int(np.prod(v.shape)) for v in tm._tnt_stage.optimizer.variables)
    variables = sum(int(np.prod(v.shape)) for v in tm.stage_model.trainable_variables)
    ranks = tnt_comm.allgather_object((tm.stage, tm.group.rank, tm.replica, digest.hexdigest(), slots, variables))
    path = str(out.parent / "sharded_all8.keras")
    tm.save(path)
    tnt_comm.barrier()
    if tnt.is_master_rank():
        loaded = keras.models.load_model(path)
        _job.write(out, {
            "history_diff": _job.max_abs_diff(history["loss"], serial_history["loss"]),
            "weight_diff": _job.max_abs_diff(weights, serial.get_weights()),
            "ranks": ranks,
            "loaded_weight_diff": _job.max_abs_diff(loaded.get_weights(), serial.get_weights()),
            "loaded_optimizer_count": [len(loaded.optimizer.variables), len(serial.optimizer.variables)],
            "loaded_optimizer_diff": _job.max_abs_diff([v.numpy() for v in loaded.optimizer.variables],
                                                       [v.numpy() for v in serial.optimizer.variables]),
        })


if __name__ == "__main__":
    main()
