"""API job: rank API, replica sync, callbacks, save/load, inputs and errors, on N ranks.

Every check records (ok, detail) under a fixed name; rank 0 writes them and the test
module asserts each one. Values that differ per rank are gathered with tnt_comm.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import os
import tempfile
from pathlib import Path

import _job
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

CHECKS: dict[str, dict] = {}


def check(name: str, ok: bool, detail: object = "") -> None:
    CHECKS[name] = {"ok": bool(ok), "detail": str(detail)[:2000]}


def gathered(value) -> list:
    return tnt_comm.allgather_object(value)


def digest(arrays) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def net(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(12, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])


def arrays(n: int, seed: int):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n).astype("int32")
    x = (rng.normal(size=(n, 8)) + y[:, None] * 0.4).astype("float32")
    return x, y


X, Y = arrays(70, 1)
VX, VY = arrays(23, 2)


def ds(x, y, batch=10):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def compiled(model, lr=0.05):
    model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.5),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def serial_and_tnt(seed=5):
    init = net(seed).get_weights()
    serial = net(seed)
    serial.set_weights(init)
    model = tnt.Model(net(seed))
    model.set_weights(init)
    return compiled(serial), compiled(model)


def check_native_ops() -> None:
    """The native collectives are built and used here (a compiler exists on every machine
    that builds tnt-comm), and they give exactly what the tf.numpy_function fallback and
    numpy give: allreduce, allgather and the fused gradient reducer, inside tf.function."""
    from tarantella._core import graph_collectives as _graph_collectives
    from tarantella._core import reducer as _reducer

    n, r = tnt.get_size(), tnt.get_rank()
    world = tnt_comm.world()
    x = tf.constant((np.arange(12, dtype=np.float32).reshape(3, 4) - 5) * (r + 1) / 3)
    grads = [tf.fill([5], float(r + 1)), tf.fill([2, 3], 0.5 * (r + 1)), tf.fill([7], -float(r))]
    slots = [_reducer.Slot(f"g{i}", tuple(g.shape), tf.float32) for i, g in enumerate(grads)]

    def traced():
        reducer = _reducer.GraphReducer(slots, threshold_bytes=32)  # buckets of ~1-2 slots

        @tf.function
        def step(x, *g):
            return (_graph_collectives.allreduce(x, world, "api", "ar"),
                    _graph_collectives.allgather_stacked(x, world, "api", "ag"),
                    reducer.reduce(list(g)))
        ops = [op.type for op in step.get_concrete_function(x, *grads).graph.get_operations()]
        return step(x, *grads), ops, reducer

    native, native_ops, native_reducer = traced()
    with tnt.native.disabled():
        fallback, fallback_ops, fallback_reducer = traced()
    want_ar = sum((np.arange(12, dtype=np.float32).reshape(3, 4) - 5) * (q + 1) / 3 for q in range(n))
    want_ag = np.stack([(np.arange(12, dtype=np.float32).reshape(3, 4) - 5) * (q + 1) / 3 for q in range(n)])
    want_g = [np.full([5], n * (n + 1) / 2), np.full([2, 3], 0.5 * n * (n + 1) / 2),
              np.full([7], -n * (n - 1) / 2)]
    same = (_job.max_abs_diff(native, fallback), _job.max_abs_diff(native[0], want_ar),
            _job.max_abs_diff(native[1], want_ag), _job.max_abs_diff(native[2], want_g))
    kinds = ({"TntAllreduce", "TntAllgather", "TntFusedSubmit", "TntFusedWaitBucket"} <= set(native_ops),
             "PyFunc" not in native_ops, "PyFunc" in fallback_ops and "TntAllreduce" not in fallback_ops)
    native_reducer.close()
    fallback_reducer.close()
    check("native_ops_used_and_equal_fallback",
          tnt.native.in_use() and tnt.native.why_not is None and all(kinds) and max(same) < 1e-5,
          dict(in_use=tnt.native.in_use(), why_not=tnt.native.why_not, kinds=kinds, diffs=same))


def check_rank_api() -> None:
    ranks = gathered(tnt.get_rank())
    check("rank_api", ranks == list(range(tnt.get_size())) and tnt.get_master_rank() == 0
          and tnt.is_master_rank() == (tnt.get_rank() == 0), ranks)


def check_initial_broadcast() -> None:
    model = compiled(tnt.Model(net(seed=1000 + tnt.get_rank())))
    rank0 = tnt_comm.broadcast_object(digest(model.model.get_weights()), 0)
    model.evaluate(ds(VX, VY), verbose=0)
    after = gathered(digest(model.get_weights()))
    check("initial_weights_broadcast_from_rank0", after == [rank0] * tnt.get_size(), after)


def check_resync_after_recompile() -> None:
    """Ranks seeded alike skip the first broadcast (equal digests); a rank-local change of
    the wrapped model's weights after that is still overwritten by the master's at the
    next sync (a recompile), not carried into evaluate."""
    model = compiled(tnt.Model(net(seed=7)))
    model.fit(ds(X, Y), epochs=1, verbose=0)
    if tnt.get_rank() == tnt.get_size() - 1:
        model.model.set_weights([w + 1.0 for w in model.model.get_weights()])
    rank0 = tnt_comm.broadcast_object(digest(model.model.get_weights()), 0)
    compiled(model)
    model.evaluate(ds(VX, VY), verbose=0)
    after = gathered(digest(model.get_weights()))
    check("recompile_resyncs_rank_local_weights", after == [rank0] * tnt.get_size(), after)


def check_numpy_inputs() -> None:
    serial, model = serial_and_tnt()
    hs = serial.fit(X, Y, batch_size=9, epochs=3, shuffle=False, verbose=0,
                    validation_data=(VX, VY)).history
    ht = model.fit(X, Y, batch_size=9, epochs=3, shuffle=False, verbose=0,
                   validation_data=(VX, VY)).history
    d = _job.history_diff(hs, ht)
    w = _job.max_abs_diff(serial.get_weights(), model.get_weights())
    e = _job.max_abs_diff(serial.evaluate(VX, VY, batch_size=5, verbose=0),
                          model.evaluate(VX, VY, batch_size=5, verbose=0))
    p = _job.max_abs_diff(serial.predict(VX, batch_size=4, verbose=0),
                          model.predict(VX, batch_size=4, verbose=0))
    check("numpy_inputs_equal_serial", d < 1e-5 and w < 2e-5 and e < 1e-5 and p < 1e-5,
          dict(history=d, weights=w, evaluate=e, predict=p))
    # validation_split takes the last fraction, as in Keras.
    serial, model = serial_and_tnt()
    hs = serial.fit(X, Y, batch_size=8, epochs=2, shuffle=False, validation_split=0.3, verbose=0).history
    ht = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, validation_split=0.3, verbose=0).history
    check("validation_split_equal_serial", _job.history_diff(hs, ht) < 1e-5, _job.history_diff(hs, ht))


def check_predict_on_every_rank() -> None:
    _, model = serial_and_tnt()
    pred = model.predict(ds(VX, VY, 6).map(lambda a, b: (a,)), verbose=0)
    digests = gathered(digest([pred]))
    check("predict_full_on_every_rank", pred.shape == (23, 3) and len(set(digests)) == 1,
          (pred.shape, digests))


def _lr_log(model_lrs: list):
    return keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: model_lrs.append(float(logs.get("learning_rate", np.nan))))


def _close(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-5
    except ValueError:
        return a == b


def check_callbacks(tmp: Path) -> None:
    # EarlyStopping: stops at the same epoch as serial.
    serial, model = serial_and_tnt()
    stop = dict(monitor="loss", min_delta=0.02, patience=0)
    hs = serial.fit(ds(X, Y), epochs=30, verbose=0, callbacks=[keras.callbacks.EarlyStopping(**stop)]).history
    ht = model.fit(ds(X, Y), epochs=30, verbose=0, callbacks=[keras.callbacks.EarlyStopping(**stop)]).history
    epochs = gathered(len(ht["loss"]))
    check("early_stopping_serial_epoch", len(hs["loss"]) < 30 and epochs == [len(hs["loss"])] * tnt.get_size(),
          dict(serial=len(hs["loss"]), tnt=epochs))

    # ReduceLROnPlateau and LearningRateScheduler: the serial learning rates.
    for name, make in {
        "reduce_lr_on_plateau": lambda: keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.5),
        "learning_rate_scheduler": lambda: keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.7),
    }.items():
        serial, model = serial_and_tnt()
        lrs, lrt = [], []
        serial.fit(ds(X, Y), epochs=5, verbose=0, callbacks=[make(), _lr_log(lrs)])
        model.fit(ds(X, Y), epochs=5, verbose=0, callbacks=[make(), _lr_log(lrt)])
        all_lrt = gathered(lrt)
        check(f"{name}_serial_rates", len(set(lrs)) > 1 and all(np.allclose(lrs, r, rtol=1e-6) for r in all_lrt),
              dict(serial=lrs, tnt=all_lrt))

    # CSVLogger: written by the master only, same numbers as serial.
    serial, model = serial_and_tnt()
    serial_csv, tnt_csv = tmp / "serial.csv", tmp / "tnt.csv"
    serial.fit(ds(X, Y), epochs=3, verbose=0, callbacks=[keras.callbacks.CSVLogger(str(serial_csv))])
    model.fit(ds(X, Y), epochs=3, verbose=0, callbacks=[keras.callbacks.CSVLogger(str(tnt_csv))])
    tnt_comm.barrier()
    if tnt.is_master_rank():
        rs = list(csv.DictReader(serial_csv.open()))
        rt = list(csv.DictReader(tnt_csv.open()))
        same = len(rs) == len(rt) == 3 and all(
            a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a) for a, b in zip(rs, rt))
        check("csv_logger_equal_serial", same, dict(serial=rs, tnt=rt))

    # ModelCheckpoint: only the master writes; files complete, no temporary left behind.
    writes = []
    inner_save = keras.Model.save_weights

    def counting_save(self, *args, **kwargs):
        writes.append(args[0] if args else kwargs.get("filepath"))
        return inner_save(self, *args, **kwargs)

    # Keras creates the checkpoint directory itself: only the master may, or ranks race.
    made_dirs = []
    inner_makedirs = os.makedirs

    def recording_makedirs(name, *args, **kwargs):
        made_dirs.append(str(name))
        return inner_makedirs(name, *args, **kwargs)

    keras.Model.save_weights = counting_save
    os.makedirs = recording_makedirs
    try:
        _, model = serial_and_tnt()
        ckpt_dir = tmp / "ckpt"
        checkpoint = keras.callbacks.ModelCheckpoint(
            str(ckpt_dir / "w-{epoch}.weights.h5"), save_weights_only=True)
        model.fit(ds(X, Y), epochs=3, verbose=0, callbacks=[checkpoint])
    finally:
        keras.Model.save_weights = inner_save
        os.makedirs = inner_makedirs
    made_per_rank = tnt_comm.allgather_object([d for d in made_dirs if d.startswith(str(tmp))])
    restored = tnt_comm.allgather_object(checkpoint.filepath)
    check("checkpoint_dirs_made_by_master_only",
          made_per_rank == [[str(ckpt_dir)]] + [[]] * (tnt.get_size() - 1)
          and set(restored) == {str(ckpt_dir / "w-{epoch}.weights.h5")},
          dict(made_per_rank=made_per_rank, filepath_after_fit=restored))
    # tnt.Model.save_weights is itself a keras.Model method override: count real writes only.
    real = [w for w in writes if ".tmp" in str(w)]
    per_rank = gathered(len(real))
    tnt_comm.barrier()
    files = sorted(p.name for p in ckpt_dir.iterdir()) if tnt.is_master_rank() else []
    check("checkpoint_only_master_writes",
          per_rank == [3] + [0] * (tnt.get_size() - 1)
          and (not tnt.is_master_rank() or files == ["w-1.weights.h5", "w-2.weights.h5", "w-3.weights.h5"]),
          dict(per_rank=per_rank, files=files))

    # Progress output only on the master rank.
    _, model = serial_and_tnt()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        model.fit(ds(X, Y), epochs=2, verbose=2)
        model.summary()
    printed = gathered(len(buf.getvalue()))
    check("progress_and_summary_only_on_master", printed[0] > 0 and all(p == 0 for p in printed[1:]), printed)

    # tnt.keras.callbacks.Callback(run_on_all_ranks=False) runs on the master only.
    calls = []
    counter = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: calls.append(e))
    model.fit(ds(X, Y), epochs=2, verbose=0,
              callbacks=[tnt.keras.callbacks.Callback(counter, run_on_all_ranks=False)])
    per_rank = gathered(len(calls))
    check("callback_master_only", per_rank == [2] + [0] * (tnt.get_size() - 1), per_rank)


def check_tensorboard_master_only(tmp: Path) -> None:
    calls = []

    class CountingTensorBoard(keras.callbacks.TensorBoard):
        def on_epoch_end(self, epoch, logs=None):
            calls.append(epoch)
            super().on_epoch_end(epoch, logs)

    _, model = serial_and_tnt()
    model.fit(ds(X, Y), epochs=2, verbose=0, callbacks=[CountingTensorBoard(log_dir=str(tmp / "tb"))])
    per_rank = gathered(len(calls))
    check("tensorboard_master_only", per_rank == [2] + [0] * (tnt.get_size() - 1), per_rank)


def check_mixed_precision() -> None:
    """mixed_float16: Keras wraps the optimizer in a LossScaleOptimizer; results as serial."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        serial, model = serial_and_tnt()
        hs = serial.fit(ds(X, Y), epochs=2, verbose=0).history
        ht = model.fit(ds(X, Y), epochs=2, verbose=0).history
        same = gathered(digest(model.get_weights()))
        d = _job.history_diff(hs, ht)
        check("mixed_precision_loss_scaled", isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
              and d < 2e-3 and len(set(same)) == 1, dict(history=d, ranks=same))
    finally:
        keras.mixed_precision.set_global_policy("float32")


def check_mixed_precision_overflow() -> None:
    """The loss-scale decision serial Keras takes when the whole batch's float16 kernel
    gradient overflows and no rank's part does (Note [Float16 overflow as serial]).

    Dense(1) without bias from 0, 8 samples of x = 1, y = -c, MSE, scale 2^15: the scaled
    kernel gradient is 65536 c over the batch and at most half that on a rank. c = 1
    overflows float16 (serial Keras skips the step, halves the scale); c = 0.5 does not.
    """
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        runs = {}
        for c in (1.0, 0.5):
            x, y = np.ones((8, 1), np.float32), np.full((8, 1), -c, np.float32)
            for wrap in (False, True):
                m = keras.Sequential([keras.Input((1,)),
                                      keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
                m = tnt.Model(m) if wrap else m
                m.compile(keras.optimizers.SGD(1e-6), "mse")
                m.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
                runs[(c, "tnt" if wrap else "serial")] = (
                    float(np.asarray(m.get_weights()[0]).ravel()[0]),
                    float(m.optimizer.dynamic_scale.numpy()), int(m.optimizer.iterations.numpy()))
        same = all(runs[(c, "serial")] == runs[(c, "tnt")] for c in (1.0, 0.5))
        serial_as_expected = runs[(1.0, "serial")][2] == 0 and runs[(0.5, "serial")][2] == 1
        check("mixed_precision_overflow_as_serial", same and serial_as_expected,
              {f"c={c} {who}": v for (c, who), v in runs.items()})
    finally:
        keras.mixed_precision.set_global_policy("float32")


def check_batch_norm_warning() -> None:
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("tarantella").addHandler(handler)
    try:
        keras.utils.set_random_seed(1)
        model = compiled(tnt.Model(keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(4), keras.layers.BatchNormalization(), keras.layers.Dense(3, activation="softmax")])))
        model.fit(ds(X, Y, batch=8), epochs=1, verbose=0)
    finally:
        logging.getLogger("tarantella").removeHandler(handler)
    warned = any("BatchNormalization" in r.getMessage() for r in records)
    check("batch_norm_small_batch_warning", warned == (tnt.get_size() > 1), [r.getMessage() for r in records])


def check_save_load(tmp: Path) -> None:
    _, model = serial_and_tnt()
    model.fit(ds(X, Y), epochs=2, verbose=0)
    path = tmp / "model.keras"
    model.save(path)
    loaded = tnt.models.load_model(path)
    same = _job.max_abs_diff(model.get_weights(), loaded.get_weights())
    # Training continues identically after reload (optimizer state is in the file).
    model.fit(ds(X, Y), epochs=1, verbose=0)
    loaded.fit(ds(X, Y), epochs=1, verbose=0)
    cont = _job.max_abs_diff(model.get_weights(), loaded.get_weights())
    check("save_load_model_roundtrip", isinstance(loaded, tnt.Model) and same == 0.0 and cont < 1e-6,
          dict(after_load=same, after_more_training=cont))

    wpath = tmp / "w.weights.h5"
    model.save_weights(wpath)
    fresh = compiled(tnt.Model(net(seed=77)))
    fresh.load_weights(wpath)
    d = _job.max_abs_diff(model.get_weights(), fresh.get_weights())
    check("save_load_weights_roundtrip", d == 0.0, d)

    from_config = tnt.models.model_from_config(model.get_config())
    from_json = tnt.models.model_from_json(model.to_json())
    clone = tnt.models.clone_model(model)
    shapes = [w.shape for w in model.get_weights()]
    check("config_json_clone", all(isinstance(m, tnt.Model) and [w.shape for w in m.get_weights()] == shapes
                                   for m in (from_config, from_json, clone)), shapes)

    leftovers = sorted(p.name for p in tmp.iterdir() if ".tmp" in p.name)
    check("no_temporary_files_left", not leftovers, leftovers)

    uncompiled = tnt.models.load_model(path, compile=False)
    try:
        uncompiled.fit(ds(X, Y), epochs=1, verbose=0)
        check("uncompiled_fit_error", False, "no error raised")
    except RuntimeError as err:
        check("uncompiled_fit_error", "compile" in str(err), err)


def expect_error(name: str, exc: type, fragment: str, fn) -> None:
    try:
        fn()
    except exc as err:
        check(name, fragment in str(err), err)
    except Exception as err:
        check(name, False, f"{type(err).__name__}: {err}")
    else:
        check(name, False, "no error raised")


def check_errors() -> None:
    _, model = serial_and_tnt()
    expect_error("error_batch_size_with_dataset", tnt.InputError, "double batching",
                 lambda: model.fit(ds(X, Y), batch_size=10, verbose=0))
    expect_error("error_generator_input", tnt.InputError, "batch_size= cannot be passed with a generator",
                 lambda: model.fit((b for b in [(X, Y)]), batch_size=10, verbose=0))
    unbatched = tf.data.Dataset.from_tensor_slices((X, Y))
    expect_error("error_unbatched_without_micro_batch", tnt.InputError, "micro",
                 lambda: model.fit(unbatched, verbose=0))
    expect_error("error_fit_before_compile", RuntimeError, "compile",
                 lambda: tnt.Model(net(1)).fit(ds(X, Y), verbose=0))
    h = model.fit(unbatched, tnt_micro_batch_size=5, epochs=1, verbose=0).history
    check("unbatched_with_micro_batch_size_trains", len(h["loss"]) == 1 and np.isfinite(h["loss"][0]), h)


def main() -> None:
    out = _job.out_path()
    with tempfile.TemporaryDirectory() as local:
        shared = Path(tnt_comm.broadcast_object(local, 0))  # one directory, rank 0's
        if tnt.is_master_rank():
            (shared / "cb").mkdir()
            (shared / "io").mkdir()
        tnt_comm.barrier()
        check_rank_api()
        check_native_ops()
        check_initial_broadcast()
        check_resync_after_recompile()
        check_numpy_inputs()
        check_predict_on_every_rank()
        check_callbacks(shared / "cb")
        check_tensorboard_master_only(shared / "cb")
        check_mixed_precision()
        check_mixed_precision_overflow()
        check_batch_norm_warning()
        check_save_load(shared / "io")
        check_errors()
        tnt_comm.barrier()
        _job.write(out, {"ranks": tnt.get_size(), "checks": CHECKS})


if __name__ == "__main__":
    main()
