"""Files of every layout, the same way (issue 28): one launch per rank count (2 and 4).

For each layout the job's size allows, a small MLP (built alike on every rank, seeded)
is compiled with Adam, trained one epoch, then:

- ``tnt.models.save_model`` writes one plain serial ``.keras`` file: on the master it
  loads in plain Keras, predicts as the distributed model does, and holds the optimizer
  state (its ``iterations`` = the steps trained);
- ``save_weights`` writes the optimizer state too (as Keras does for a compiled model);
- ``overwrite=False`` on an existing path raises FileExistsError on every rank, for
  ``save``, ``save_weights`` and ``tnt.models.save_model``; nothing is written;
- ``tnt_save_all_devices=True`` gives every rank its own file (``<name>.rank<r>.keras``),
  the whole serial model also where only the master holds it;
- ``export`` writes a SavedModel whose ``serve`` gives the outputs of a serial export of
  the saved model (made on the master with plain Keras);
- on 2 ranks, the TENSOR t = 2 file loads with ``ALL, tensor_parallel_size=1`` (data
  replicas) and predicts as plain Keras does with the same file.

Against serial Keras trained in the same job (same model class, seed, batches):

- History has serial Keras' keys and values: the model's class has a ``compile`` of its
  own that adds a default weighted metric (as keras-hub's tasks do), and an explicit
  metric is compiled too;
- ``get_weights()`` on every rank is the serial model's list (order, shapes, values) and
  the saved file's;
- ``set_weights(list)`` with a serial-shaped list (a serial model built with another seed)
  then ``predict`` gives that serial model's predictions, on every rank, and
  ``get_weights()`` gives the list back; a list one array short or with a wrong shape
  raises ValueError on every rank.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import _job
import h5py
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

S = tnt.ParallelStrategy
N = tnt.get_size()
WIDTH = 8  # divisible by t = 2 and 4


@keras.saving.register_keras_serializable(package="tnt_tests")
class WithDefaults(keras.Model):
    """A functional model whose own ``compile`` adds a default weighted metric (as
    keras-hub's tasks add ``sparse_categorical_accuracy``)."""

    def compile(self, optimizer="rmsprop", loss=None, weighted_metrics="auto", **kwargs):
        if weighted_metrics == "auto":
            weighted_metrics = [keras.metrics.MeanAbsoluteError(name="default_mae")]
        super().compile(optimizer=optimizer, loss=loss, weighted_metrics=weighted_metrics, **kwargs)

    def compile_from_config(self, config) -> None:
        """Keras' own, which skips classes with a compile of their own (files load compiled)."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)


def compile_(model) -> None:
    """The one compile every layout and the serial reference get."""
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                  metrics=[keras.metrics.MeanSquaredError(name="mse_metric")])


def mlp(marked: bool = False, seed: int = 7) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(WIDTH, activation="relu", name="up1")(x)
    h = keras.layers.Dense(6, name="down1")(h)
    if marked:
        h = tnt.keras.layers.SplitLayer(name="cut")(h)
    h = keras.layers.Dense(WIDTH, activation="relu", name="up2")(h)
    h = keras.layers.Dense(6, name="down2")(h)
    return WithDefaults(x, keras.layers.Dense(3, name="head")(h), name="mlp")


LAYOUTS = {
    2: {
        "data": lambda: tnt.Model(mlp()),
        "pipelining_p2": lambda: tnt.Model(mlp(), parallel_strategy=S.PIPELINING, num_pipeline_stages=2,
                                           num_micro_batches=2),
        "tensor_t2": lambda: tnt.Model(mlp(), parallel_strategy=S.TENSOR, tensor_parallel_size=2),
        "all_t2": lambda: tnt.Model(mlp(), parallel_strategy=S.ALL, tensor_parallel_size=2),
    },
    4: {
        "data": lambda: tnt.Model(mlp()),
        "pipelining_p4": lambda: tnt.Model(mlp(), parallel_strategy=S.PIPELINING, num_pipeline_stages=4,
                                           num_micro_batches=2),
        "tensor_t4": lambda: tnt.Model(mlp(), parallel_strategy=S.TENSOR, tensor_parallel_size=4),
        "all_p2_t2": lambda: tnt.Model(mlp(marked=True), parallel_strategy=S.ALL, tensor_parallel_size=2,
                                       num_micro_batches=2),
        "all_p2_replicas2": lambda: tnt.Model(mlp(), parallel_strategy=S.ALL, num_pipeline_stages=2,
                                              num_micro_batches=2),
    },
}
BATCH, SAMPLES = 8, 32


def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = rng.normal(size=(SAMPLES, 3)).astype("float32")
    return x, y


@functools.cache  # the same for every layout of a kind: trained once per job, not per layout
def serial_reference(marked: bool) -> dict:
    """Serial Keras: the same model trained on the same batches, in this process."""
    x, y = data()
    serial = mlp(marked)
    compile_(serial)
    history = serial.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=1, verbose=0).history
    return {"history": history, "weights": serial.get_weights()}


def weights_diff(a, b) -> float:
    """Largest difference of two weight lists; inf when their lengths or shapes differ."""
    if len(a) != len(b) or any(np.shape(u) != np.shape(v) for u, v in zip(a, b)):
        return float("inf")
    return _job.max_abs_diff(list(a), list(b))


def raises_value_error(fn) -> str | None:
    """The ValueError's message (None if nothing or something else was raised)."""
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None  # any other exception propagates and fails the job


def check_weights_api(model, ref: dict, saved: Path, x: np.ndarray) -> dict:
    """get_weights after fit, set_weights with a serial list, and bad lists (every rank)."""
    out = {}
    got = model.get_weights()
    out["get_weights_vs_serial_per_rank"] = tnt_comm.allgather_object(weights_diff(got, ref["weights"]))
    if tnt.is_master_rank():
        out["get_weights_vs_saved_file"] = weights_diff(got, keras.saving.load_model(saved).get_weights())
    fresh = mlp(seed=11)
    fresh_weights = fresh.get_weights()
    model.set_weights(fresh_weights)
    out["set_then_predict_per_rank"] = tnt_comm.allgather_object(_job.max_abs_diff(
        model.predict(x, batch_size=BATCH, verbose=0), fresh.predict(x, batch_size=BATCH, verbose=0)))
    out["set_then_get_per_rank"] = tnt_comm.allgather_object(weights_diff(model.get_weights(), fresh_weights))
    wrong_shape = [np.zeros((7, 7), "float32"), *fresh_weights[1:]]
    out["short_list_error_per_rank"] = tnt_comm.allgather_object(
        raises_value_error(lambda: model.set_weights(fresh_weights[:-1])))
    out["wrong_shape_error_per_rank"] = tnt_comm.allgather_object(
        raises_value_error(lambda: model.set_weights(wrong_shape)))
    out["weights_kept_after_errors_per_rank"] = tnt_comm.allgather_object(
        weights_diff(model.get_weights(), fresh_weights))
    return out


def raises_exists(fn) -> bool:
    try:
        fn()
    except FileExistsError:
        return True
    return False


def serve(directory: Path, x: np.ndarray) -> np.ndarray:
    loaded = tf.saved_model.load(os.fspath(directory))
    return np.asarray(loaded.serve(tf.constant(x)))


def run_layout(name: str, make, work: Path) -> dict:
    x, y = data()
    model = make()
    ref = serial_reference(marked=name == "all_p2_t2")
    compile_(model)
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=1, verbose=0).history
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    out = {"class": type(model).__name__}
    out["history_keys"] = {"serial": sorted(ref["history"]), "tnt": sorted(history)}
    common = sorted(set(ref["history"]) & set(history))
    out["history_diff"] = _job.max_abs_diff([ref["history"][k] for k in common], [history[k] for k in common])
    if hasattr(model, "schedule_grid"):  # pipelines: the schedule as a printable grid
        out["schedule_grid_first_line"] = model.schedule_grid().splitlines()[0]
    path, weights = work / f"{name}.keras", work / f"{name}.weights.h5"
    tnt.models.save_model(model, path)
    model.save_weights(weights)
    stamp = (path.stat().st_mtime_ns, weights.stat().st_mtime_ns)
    out["overwrite_false_raises"] = [
        raises_exists(lambda: model.save(path, overwrite=False)),
        raises_exists(lambda: model.save_weights(weights, overwrite=False)),
        raises_exists(lambda: tnt.models.save_model(model, path, overwrite=False)),
    ]
    out["overwrite_false_kept_files"] = (path.stat().st_mtime_ns, weights.stat().st_mtime_ns) == stamp
    export = work / f"{name}_export"
    model.export(export, verbose=False)
    copies = work / f"{name}_copy.keras"
    model.save(copies, tnt_save_all_devices=True)  # each rank its own file, name.rank<r>.keras
    mine = work / f"{name}_copy.rank{tnt.get_rank()}.keras"
    out["all_devices_files"] = tnt_comm.allgather_object(mine.exists())
    if tnt.is_master_rank():
        plain = keras.saving.load_model(path)
        out["saved_predict_diff"] = _job.max_abs_diff(plain.predict(x, batch_size=BATCH, verbose=0), predicted)
        out["saved_iterations"] = int(plain.optimizer.iterations.numpy())
        with h5py.File(weights, "r") as f:
            out["weights_file_optimizer_vars"] = len(f["optimizer"]["vars"]) if "optimizer" in f else 0
        serial_export = work / f"{name}_serial_export"
        plain.export(serial_export, verbose=False)
        out["export_serve_diff"] = _job.max_abs_diff(serve(export, x), serve(serial_export, x))
        last = keras.saving.load_model(work / f"{name}_copy.rank{N - 1}.keras")
        out["all_devices_last_rank_predict_diff"] = _job.max_abs_diff(
            last.predict(x, batch_size=BATCH, verbose=0), predicted)
    out.update(check_weights_api(model, ref, path, x))
    return out


def main() -> None:
    out_file = _job.out_path()
    work = out_file.parent
    results = {"ranks": N, "layouts": {}}
    for name in _job.only(LAYOUTS[N]):
        results["layouts"][name] = run_layout(name, LAYOUTS[N][name], work)
    if N == 2:  # the t = 2 file as data replicas (tensor_parallel_size=1) on 2 ranks
        x, _ = data()
        loaded = tnt.models.load_model(work / "tensor_t2.keras", parallel_strategy=S.ALL, tensor_parallel_size=1)
        got = loaded.predict(x, batch_size=BATCH, verbose=0)
        results["t2_file_as_all_q1"] = {"class": type(loaded).__name__}
        if tnt.is_master_rank():
            plain = keras.saving.load_model(work / "tensor_t2.keras")
            results["t2_file_as_all_q1"]["predict_diff"] = _job.max_abs_diff(
                got, plain.predict(x, batch_size=BATCH, verbose=0))
    _job.write(out_file, results)


if __name__ == "__main__":
    main()
