"""Pipelining job: PIPELINING on N = p ranks and ALL on N = 2p ranks against serial Keras.

Every case trains the same model serially (plain Keras, computed on every rank: the
models are small) and pipelined from the same initial weights on the same global
batches, then records the largest differences (History, weights, evaluate, predict),
whether GPipe and 1F1B ended bitwise identical, whether every rank saw the same logs,
whether replicas hold bitwise-identical stages, and how many variables each rank holds.
Save/load cases round-trip through one ``.keras`` file. Rank 0 writes the JSON.

    --layout pipelining|all  (ALL runs N/2 replicas of 2-stage pipelines)
    --shared DIR             the 2-rank job saves its p = 2 file (and the serial predictions)
                             there; the 3-rank job loads it into 3 stages

Pipelined models are built under ``tnt.pipelining.deferred_variables`` (the user's model
holds no memory for weights); each rank reports the bytes of the Keras variables it
materialised while building, training and loading, found by scanning the process.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _job
import _replica_stats
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

SplitLayer = tnt.keras.layers.SplitLayer
LOSS = "sparse_categorical_crossentropy"
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam_clip": lambda: keras.optimizers.Adam(0.02, global_clipnorm=0.05),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    # Dynamic loss scaling that overflows: the first steps are skipped and the scale goes
    # down, then up every 2 finite steps until it overflows again (see lso_mlp).
    "lso": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=LSO_SCALE,
                                                       dynamic_growth_steps=2),
}
#: Initial loss scale of the "lso" case: at the initial weights stage 0's gradients
#: overflow float32 and the last stage's do not (the job checks it on the serial model;
#: the "f16" case is the converse, at the scale compile gives a mixed_float16 model).
LSO_SCALE = 2.0**122


# -- models (explicit layer names: the serial and pipelined copies match by name) ----------
def mlp() -> keras.Model:
    keras.utils.set_random_seed(3)
    x = inp = keras.Input((10,), name="x")
    for k, w in enumerate((24, 24, 16, 16)):
        x = keras.layers.Dense(w, activation="tanh", name=f"d{k}")(x)
    out = keras.layers.Dense(3, activation="softmax", name="out")(x)
    return keras.Model(inp, out, name="mlp")


def cnn() -> keras.Model:
    keras.utils.set_random_seed(4)
    return keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(4, 3, activation="relu", name="c0"),
        keras.layers.MaxPooling2D(name="p0"),
        keras.layers.Conv2D(8, 3, activation="relu", name="c1"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(16, activation="relu", name="d0"),
        keras.layers.Dense(3, activation="softmax", name="out"),
    ], name="cnn")


def skip_model(stages: int) -> keras.Model:
    """Two inputs, L2 on stage 0, stage 0's output also used by the last stage."""
    keras.utils.set_random_seed(5)
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    x0 = keras.layers.Dense(8, activation="relu", name="d0",
                            kernel_regularizer=keras.regularizers.L2(0.05))(a)
    x = SplitLayer(name="cut0")(x0)
    x = keras.layers.Dense(8, activation="relu", name="d1")(x)
    if stages == 3:
        x = keras.layers.Dense(8, activation="relu", name="d2")(SplitLayer(name="cut1")(x))
    h = keras.layers.Concatenate(name="cat")([x, x0, keras.layers.Dense(4, name="db")(b)])
    return keras.Model([a, b], keras.layers.Dense(3, activation="softmax", name="out")(h), name="skip")


def lso_mlp() -> keras.Model:
    """Inputs of size 1e4 into a small first kernel: stage 0's weight gradients are ~1e4
    times the last stage's, so a loss scale can overflow stage 0 alone; later, once stage
    0's tanh saturates, the growing scale overflows the last stage alone."""
    keras.utils.set_random_seed(6)
    x = inp = keras.Input((10,), name="x")
    x = keras.layers.Dense(16, activation="tanh", name="l0",
                           kernel_initializer=keras.initializers.RandomNormal(stddev=1e-4))(x)
    x = keras.layers.Dense(16, activation="tanh", name="l1")(SplitLayer(name="cut")(x))
    return keras.Model(inp, keras.layers.Dense(3, activation="softmax", name="out")(x), name="lso")


def f16_mlp() -> keras.Model:
    """Built under the ``mixed_float16`` policy (so compile wraps the optimizer in a
    LossScaleOptimizer at Keras' default scale 2^15), which is restored afterwards: other
    cases stay float32. Stage 0 ends in biases of size ~F16_BIAS and the last stage's first
    kernel is ~1e-3, so at the scale 2^15 the last stage's kernel gradient x^T g (x the
    boundary activation) overflows float16 while the boundary gradient W^T g, and so
    stage 0's gradients, stay finite: only the last stage can decide to skip."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(7)
        x = inp = keras.Input((10,), name="x")
        x = keras.layers.Dense(16, name="l0",
                               bias_initializer=keras.initializers.RandomUniform(-F16_BIAS, F16_BIAS))(x)
        x = keras.layers.Dense(16, activation="tanh", name="l1",
                               kernel_initializer=keras.initializers.RandomNormal(stddev=1e-3))(SplitLayer(name="cut")(x))
        x = keras.layers.Dense(3, name="out")(x)
        out = keras.layers.Activation("softmax", dtype="float32", name="prob")(x)  # Keras' advice
        return keras.Model(inp, out, name="f16")
    finally:
        keras.config.set_dtype_policy(previous)


def embedding_model() -> keras.Model:
    """Token ids into an Embedding on stage 0: its gradient is a tf.IndexedSlices per
    micro-batch, which serial Keras' Adam sees as one list of slices over the whole batch."""
    keras.utils.set_random_seed(8)
    x = inp = keras.Input((6,), dtype="int32", name="ids")
    x = keras.layers.Embedding(8, 6, name="emb")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    x = keras.layers.Dense(16, activation="tanh", name="d0")(x)
    x = keras.layers.Dense(16, activation="tanh", name="d1")(SplitLayer(name="cut")(x))
    return keras.Model(inp, keras.layers.Dense(3, activation="softmax", name="out")(x), name="emb")


@keras.saving.register_keras_serializable("tnt_tests")
class WithUnusedWeight(keras.layers.Layer):
    """A Dense-like layer holding a weight its call never reads: serial Keras' optimizer
    leaves such a weight alone; under AdamW a zero gradient would still decay it."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 16), name="kernel")
        self.unused = self.add_weight(shape=(5,), initializer="ones", name="unused")

    def call(self, x):
        return keras.ops.tanh(x @ self.kernel)


def unused_weight_model() -> keras.Model:
    """An MLP with an unread weight on each stage (AdamW, weight decay)."""
    keras.utils.set_random_seed(4)
    x = inp = keras.Input((10,), name="x")
    x = WithUnusedWeight(name="u0")(keras.layers.Dense(16, activation="tanh", name="d0")(x))
    x = WithUnusedWeight(name="u1")(SplitLayer(name="cut")(x))
    return keras.Model(inp, keras.layers.Dense(3, activation="softmax", name="out")(x), name="unused")


#: Stage 0's output scale in ``f16_mlp``.
F16_BIAS = 300.0


def data(kind: str, n: int, seed: int):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n).astype("int32")
    if kind == "lso":
        return (rng.normal(size=(n, 10)).astype("float32") + y[:, None] * 0.3) * 1e4, y
    if kind == "emb":  # 8 tokens, 6 per row: tokens repeat within every micro-batch
        return (rng.integers(0, 6, size=(n, 6)) + y[:, None]).astype("int32") % 8, y
    if kind == "cnn":
        x = rng.normal(size=(n, 12, 12, 1)).astype("float32") + y[:, None, None, None] * 0.3
    elif kind == "skip":
        x = (rng.normal(size=(n, 6)).astype("float32") + y[:, None] * 0.3, rng.normal(size=(n, 4)).astype("float32"))
    else:
        x = rng.normal(size=(n, 10)).astype("float32") + y[:, None] * 0.3
    return x, y


def ds(x, y, batch):
    element = (x, y) if y is not None else (x,)
    return tf.data.Dataset.from_tensor_slices(element).batch(batch)


def digest(arrays) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def max_diff(a, b) -> float:
    return _job.max_abs_diff(a, b)


def layer_weights(model: keras.Model) -> dict[str, list]:
    return {layer.name: layer.get_weights() for layer in model.layers if layer.weights}


def stage_weight_diff(model, ref_layers: dict[str, list]) -> float:
    """This rank's stage against the same-named layers of the serial model, max over ranks."""
    mine = 0.0
    for layer in model.stage_layers():  # an interleaved stage's: each of its chunks'
        if layer.weights:
            mine = max(mine, max_diff(layer.get_weights(), ref_layers[layer.name]))
    return max(tnt_comm.allgather_object(mine))


def deferred(make):
    """``make()`` built with deferred variables: the whole model is never materialised."""
    with tnt.pipelining.deferred_variables():
        return make()


def live_variables() -> dict[int, int]:
    """id -> bytes of every Keras variable with a value in this process (a scan of the heap)."""
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, keras.Variable) and getattr(obj, "_value", None) is not None:
            out[id(obj)] = int(np.prod(obj.shape)) * np.dtype(obj.dtype).itemsize
    return out


def new_bytes(before: dict[int, int]) -> int:
    return sum(b for k, b in live_variables().items() if k not in before)


def training_bytes(model: keras.Model, optimizer) -> int:
    """Weights + optimizer variables (what a trained model keeps between steps)."""
    def nbytes(vs):
        return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in vs)
    return nbytes(model.weights) + nbytes(optimizer.variables if optimizer is not None else [])


def loss_scale_state(optimizer) -> list | None:
    """[dynamic loss scale, applied (not skipped) steps] of a LossScaleOptimizer."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    return [float(optimizer.dynamic_scale.numpy()), int(optimizer.iterations.numpy())]


def overflowing_layers(model: keras.Model, x, y, scale: float) -> list[str]:
    """The layers whose weight gradients of ``scale`` x the loss on (x, y) are not finite."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x, training=True))) * scale
    grads = tape.gradient(loss, model.trainable_variables)
    return sorted({v.path.split("/")[0] for v, g in zip(model.trainable_variables, grads)
                   if not bool(tf.reduce_all(tf.math.is_finite(g)))})


def on_master(fn):
    """``fn()`` on the master only (the serial reference), its result on every rank."""
    return tnt_comm.broadcast_object(fn() if tnt.is_master_rank() else None, 0)


# -- one training case ------------------------------------------------------------------------
#: The master's serial runs, by everything they depend on (not the schedule, m or p).
_SERIAL: dict[tuple, dict] = {}


def run_case(kind, make, opt, *, strategy, p, m, schedule, batch, n, epochs, spe=1) -> dict:
    """One case; ``spe``: compile's steps_per_execution (then also the batch-end logs)."""
    x, y = data(kind, n, seed=11)
    vx, vy = data(kind, 17, seed=12)

    def serial_run():
        serial = make()
        serial.compile(OPTIMIZERS[opt](), LOSS, metrics=["accuracy"], steps_per_execution=spe)
        initial_scale = getattr(serial.optimizer, "initial_scale", None)  # a LossScaleOptimizer's
        t0 = time.perf_counter()
        seen = BatchLogs()
        history = serial.fit(ds(x, y, batch), epochs=epochs, validation_data=ds(vx, vy, 7), verbose=0,
                             callbacks=[seen]).history
        seconds = time.perf_counter() - t0
        return {"history": history, "batch_ends": seen.seen, "evaluate": serial.evaluate(ds(vx, vy, 7), verbose=0),
                "predict": serial.predict(ds(vx, None, 7), verbose=0), "layers": layer_weights(serial),
                "variables": len(serial.weights), "seconds": seconds,
                "training_bytes": training_bytes(serial, serial.optimizer),
                "optimizer": [v.numpy() for v in serial.optimizer.variables if "iteration" not in v.path],
                "loss_scale": loss_scale_state(serial.optimizer), "initial_scale": initial_scale,
                "model": serial}

    serial_model = []  # the master keeps its serial model for the save/load checks

    def reference():
        key = (kind, make, opt, batch, n, epochs, spe)  # a GPipe case and its 1F1B twin: one serial run
        if key not in _SERIAL:
            _SERIAL[key] = serial_run()
        out = dict(_SERIAL[key])
        serial_model.append(out.pop("model"))
        return out

    ref = on_master(reference)
    ref["model"] = serial_model[0] if serial_model else None
    overflow_at_start = on_master(lambda: overflowing_layers(make(), x[:batch], y[:batch], ref["initial_scale"])) \
        if ref["initial_scale"] is not None else None
    gc.collect()
    before = live_variables()
    user_model = deferred(make)
    schedule, _, remat = schedule.partition("+")  # "gpipe+stages": remat="stages"
    chunks = {"virtual_stages": 2} if schedule == "interleaved" else {}
    model = tnt.Model(user_model, parallel_strategy=strategy, num_pipeline_stages=p, num_micro_batches=m,
                      pipeline_schedule=schedule, remat=remat or None, **chunks)
    model.compile(OPTIMIZERS[opt](), LOSS, metrics=["accuracy"], steps_per_execution=spe)
    t0 = time.perf_counter()
    seen = BatchLogs()
    hist = model.fit(ds(x, y, batch), epochs=epochs, validation_data=ds(vx, vy, 7), verbose=0,
                     callbacks=[seen]).history
    t_pipe = time.perf_counter() - t0
    gc.collect()
    materialised = new_bytes(before)  # stage weights + its optimizer + the last stage's metrics
    stage_bytes = training_bytes(model.stage_model, model._tnt_stage.optimizer)
    user_deferred = all(v._value is None for v in user_model.weights)
    evaluated = model.evaluate(ds(vx, vy, 7), verbose=0)
    predicted = model.predict(ds(vx, None, 7), verbose=0)
    everyone = tnt_comm.allgather_object((hist, evaluated, digest([np.asarray(predicted)]),
                                          model.stage, model.replica, digest(model.stage_model.get_weights()),
                                          len(model.stage_model.weights), model.peak_micro_batches_in_flight,
                                          materialised, stage_bytes, user_deferred,
                                          loss_scale_state(model._tnt_stage.optimizer)))
    by_stage: dict[int, set] = {}
    for _, _, _, stage, _, wdigest, *_ in everyone:
        by_stage.setdefault(stage, set()).add(wdigest)
    return {
        "history_diff": _job.history_diff(ref["history"], hist),
        "weight_diff": stage_weight_diff(model, ref["layers"]),
        "evaluate_diff": max_diff(ref["evaluate"], evaluated),
        "predict_diff": max_diff(ref["predict"], predicted),
        "predict_rows": [len(ref["predict"]), int(np.shape(predicted)[0])],
        "history_keys": sorted(hist),
        "batch_ends": batch_ends_compared(ref["batch_ends"], seen.seen),
        "same_logs_on_all_ranks": all(e[0] == everyone[0][0] and e[1] == everyone[0][1] and e[2] == everyone[0][2]
                                      for e in everyone),
        "replicas_identical": all(len(d) == 1 for d in by_stage.values()),
        "variables_per_rank": [e[6] for e in everyone],
        "serial_variables": ref["variables"],
        "serial_training_bytes": ref["training_bytes"],
        "materialised_bytes_per_rank": [e[8] for e in everyone],
        "stage_training_bytes_per_rank": [e[9] for e in everyone],
        "user_model_stays_deferred": all(e[10] for e in everyone),
        "peak_in_flight": [e[7] for e in everyone],
        "loss_scale": None if ref["loss_scale"] is None else {
            "serial": ref["loss_scale"], "per_rank": [e[11] for e in everyone],
            "steps": epochs * -(-n // batch), "overflow_at_start": overflow_at_start},
        "weights_digest": digest(model.stage_model.get_weights()),
        "policy": {"model": user_model.dtype_policy.name, "boundaries": [b.dtype for b in model.plan.boundaries],
                   "optimizer": type(model._tnt_stage.optimizer).__name__,
                   "global_after": keras.config.dtype_policy().name},
        "seconds": [ref["seconds"], t_pipe],
        "model": model,
        "ref": ref,
    }


def compare_schedules(results: dict, a: str, b: str) -> bool:
    """GPipe and 1F1B bitwise identical on every rank (each rank compares its own stage)."""
    same = results[a]["weights_digest"] == results[b]["weights_digest"]
    return all(tnt_comm.allgather_object(same))


def compare_serial_weights(results: dict, a: str, b: str) -> bool:
    """Two cases' whole models bitwise identical (their stages may hold different layers:
    the serial weight lists, gathered on every rank, are compared)."""
    same = digest(results[a]["model"].get_weights()) == digest(results[b]["model"].get_weights())
    return all(tnt_comm.allgather_object(same))


# -- save / load ------------------------------------------------------------------------------
def save_load_checks(case: dict, strategy, p: int, tmp: Path, load_stages: list[int],
                     shared: Path | None = None) -> dict:
    """Pipelined save -> plain Keras load; load into q stages -> identical predict; a serial
    save loaded pipelined continues training as serial Keras does."""
    model, ref = case["model"], case["ref"]
    path = tmp / "pipelined.keras"
    with largest_received(model) as received:
        model.save(path)
    streamed = streamed_file_check(model, path, tmp)
    x, _ = data("mlp", 13, seed=21)
    xs, ys = data("mlp", 31, seed=22)
    serial_path = tmp / "serial.keras"

    def serial_side():
        serial = ref["model"]
        plain = keras.saving.load_model(path)  # plain Keras opens the gathered file
        serial.save(serial_path)
        cont_ref = keras.saving.load_model(serial_path)
        history = cont_ref.fit(ds(xs, ys, 9), epochs=2, verbose=0).history
        return {
            "plain_keras_weight_diff": max_diff(plain.get_weights(), serial.get_weights()),
            "plain_keras_has_optimizer_state": bool(plain.optimizer is not None and plain.optimizer.built
                                                    and int(plain.optimizer.iterations.numpy()) > 0),
            "plain_keras_optimizer_diff": max_diff(
                [v.numpy() for v in plain.optimizer.variables if "iteration" not in v.path], ref["optimizer"]),
            "predict": serial.predict(x, verbose=0), "cont_history": history, "cont_layers": layer_weights(cont_ref),
        }

    side = on_master(serial_side)
    out = {k: v for k, v in side.items() if k.startswith("plain_keras")}
    out["save_largest_message_bytes"] = received[0]
    out["largest_variable_bytes"] = max(w.nbytes for ws in ref["layers"].values() for w in ws)
    out.update(streamed)
    for q in load_stages:
        strat = tnt.ParallelStrategy.PIPELINING if q == tnt.get_size() else tnt.ParallelStrategy.ALL
        gc.collect()
        before = live_variables()
        loaded = tnt.models.load_model(path, parallel_strategy=strat, num_pipeline_stages=q)
        gc.collect()
        if q > 1:
            out[f"load_q{q}_materialised_vs_stage_bytes"] = tnt_comm.allgather_object(
                [new_bytes(before), training_bytes(loaded.stage_model, loaded._tnt_stage.optimizer)])
        out[f"load_q{q}_predict_diff"] = max_diff(loaded.predict(x, batch_size=5, verbose=0), side["predict"])
        out[f"load_q{q}_stages"] = loaded.plan.num_stages if q > 1 else 1
    if shared is not None:  # the 3-rank job loads this p = 2 file into 3 stages
        if tnt.is_master_rank():
            shutil.copyfile(path, shared / "p2.keras")
            np.save(shared / "p2_predict.npy", side["predict"])
        tnt_comm.barrier()
    cont = tnt.models.load_model(serial_path, parallel_strategy=strategy,
                                 num_pipeline_stages=p, num_micro_batches=3)
    hist = cont.fit(ds(xs, ys, 9), epochs=2, verbose=0).history
    out["continue_history_diff"] = _job.history_diff(side["cont_history"], hist)
    out["continue_weight_diff"] = stage_weight_diff(cont, side["cont_layers"])
    return out


@contextlib.contextmanager
def largest_received(model):
    """[bytes of the largest array this rank received inside the block] (the master's
    messages during a save: a stage's variables one at a time, never a whole stage)."""
    transport = model._tnt_stage.transport
    largest = [0]

    def counting(stage, header, dtype, shape):
        out = type(transport).recv(transport, stage, header, dtype, shape)
        largest[0] = max(largest[0], out.nbytes)
        return out

    transport.recv = counting
    try:
        yield largest
    finally:
        del transport.recv


def streamed_file_check(model, path: Path, tmp: Path) -> dict:
    """The streamed ``.keras`` file against Keras' own save of the serial model filled from
    the stages (``_job.same_file_as_keras``)."""
    full = model._tnt_gather_serial()  # every rank takes part; the serial model on the master
    return on_master(lambda: _job.same_file_as_keras(path, full, tmp / "gathered.keras"))


def interleaved_save_load(case: dict, tmp: Path) -> dict:
    """An interleaved model (two chunks per rank) saves one plain Keras file and loads back
    into interleaved stages holding the very same weights and optimizer state."""
    model, ref = case["model"], case["ref"]
    path = tmp / "interleaved.keras"
    model.save(path)
    x, _ = data("mlp", 13, seed=21)

    def serial_side():
        plain = keras.saving.load_model(path)
        return {"plain_keras_weight_diff": max_diff(plain.get_weights(), ref["model"].get_weights()),
                "plain_keras_optimizer_diff": max_diff(
                    [v.numpy() for v in plain.optimizer.variables if "iteration" not in v.path], ref["optimizer"]),
                "predict": plain.predict(x, verbose=0)}

    side = on_master(serial_side)
    loaded = tnt.models.load_model(path, parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_pipeline_stages=2,
                                   num_micro_batches=4, pipeline_schedule="interleaved", virtual_stages=2)
    same = (digest(loaded.stage_model.get_weights()) == digest(model.stage_model.get_weights())
            and digest([v.numpy() for v in loaded._tnt_stage.optimizer.variables])
            == digest([v.numpy() for v in model._tnt_stage.optimizer.variables]))
    return {"plain_keras_weight_diff": side["plain_keras_weight_diff"],
            "plain_keras_optimizer_diff": side["plain_keras_optimizer_diff"],
            "chunks_per_rank": tnt_comm.allgather_object(len(loaded._tnt_stage.chunks)),
            "loaded_identical": all(tnt_comm.allgather_object(same)),
            "loaded_predict_diff": max_diff(loaded.predict(x, batch_size=5, verbose=0), side["predict"])}


def load_saved_at_p2(shared: Path) -> dict:
    """The 2-rank job's p = 2 file loaded into this job's stages: the same predictions."""
    x, _ = data("mlp", 13, seed=21)
    gc.collect()
    before = live_variables()
    loaded = tnt.models.load_model(shared / "p2.keras", parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                                   num_pipeline_stages=tnt.get_size())
    gc.collect()
    mem = tnt_comm.allgather_object([new_bytes(before),
                                     training_bytes(loaded.stage_model, loaded._tnt_stage.optimizer)])
    predicted = loaded.predict(x, batch_size=5, verbose=0)
    return {"stages": loaded.plan.num_stages, "materialised_vs_stage_bytes": mem,
            "predict_diff": max_diff(predicted, np.load(shared / "p2_predict.npy"))}


class Interrupted(RuntimeError):
    """The simulated interruption."""


class StopAtEpoch(keras.callbacks.Callback):
    """Ends fit with an error when ``epoch`` begins (on every rank alike): an interruption."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise Interrupted(f"interrupted at epoch {epoch}")


def backup_resume_check(tmp: Path) -> dict:
    """BackupAndRestore: interrupted at epoch 2 of 4, resumed by the same call == serial 4 epochs."""
    x, y = data("mlp", 29, seed=41)
    epochs, stop = 4, 2

    def serial():
        model = mlp()
        model.compile(OPTIMIZERS["adam"](), LOSS, metrics=["accuracy"])
        history = model.fit(ds(x, y, 8), epochs=epochs, verbose=0).history
        return {"history": history, "layers": layer_weights(model)}

    ref = on_master(serial)
    backup_dir = str(tmp / "backup")

    def run(callbacks):
        model = tnt.Model(deferred(mlp), parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                          num_pipeline_stages=tnt.get_size(), num_micro_batches=3)
        model.compile(OPTIMIZERS["adam"](), LOSS, metrics=["accuracy"])
        history = model.fit(ds(x, y, 8), epochs=epochs, verbose=0,
                            callbacks=[keras.callbacks.BackupAndRestore(backup_dir), *callbacks])
        return model, history

    interrupted = False
    try:
        run([StopAtEpoch(stop)])
    except Interrupted:
        interrupted = True
    model, history = run([])
    resumed_epochs = len(history.history["loss"])
    tail = {k: v[stop:] for k, v in ref["history"].items()}
    return {"interrupted": interrupted, "resumed_epochs": resumed_epochs,
            "history_diff": _job.history_diff(tail, history.history),
            "weight_diff": stage_weight_diff(model, ref["layers"]),
            "backup_removed": not Path(backup_dir).exists()}


def validation_split_check() -> float:
    """fit(arrays, validation_split=, class_weight=) against serial Keras' History."""
    x, y = data("mlp", 40, seed=31)
    weights = {0: 1.0, 1: 2.0, 2: 0.5}

    def serial():
        model = mlp()
        model.compile(OPTIMIZERS["adam"](), LOSS, metrics=["accuracy"])
        return model.fit(x, y, batch_size=9, epochs=2, validation_split=0.25, shuffle=False,
                         class_weight=weights, verbose=0).history

    ref = on_master(serial)
    model = tnt.Model(mlp(), parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_pipeline_stages=2,
                      num_micro_batches=3)
    model.compile(OPTIMIZERS["adam"](), LOSS, metrics=["accuracy"])
    history = model.fit(x, y, batch_size=9, epochs=2, validation_split=0.25, shuffle=False,
                        class_weight=weights, verbose=0).history
    return _job.history_diff(ref, history)


class BatchLogs(keras.callbacks.Callback):
    """Records what callbacks see at every batch end: (batch index, logs)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append([int(batch), {k: float(v) for k, v in (logs or {}).items()}])


def batch_ends_compared(serial: list, pipelined: list) -> dict:
    """Batch indices and logs callbacks saw at each batch end, serial against pipelined."""
    keys_equal = [sorted(a[1]) for a in serial] == [sorted(b[1]) for b in pipelined]
    return {"batches": [[b for b, _ in serial], [b for b, _ in pipelined]], "keys_equal": keys_equal,
            "logs_diff": max_diff([[a[1][k] for k in sorted(a[1])] for a in serial],
                                  [[b[1][k] for k in sorted(b[1])] for b in pipelined]) if keys_equal else None}


def predict_uncompiled_check() -> dict:
    """``predict`` of a pipelined model never compiled (Keras' loops then default to a traced
    step; the schedule's boundaries are numpy: it must run eagerly) against serial predict."""
    keras.utils.set_random_seed(11)
    inp = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="a")(inp)
    out = keras.layers.Dense(3, name="b")(SplitLayer(name="cut")(h))
    serial = keras.Model(inp, out)
    x = np.random.default_rng(5).normal(size=(10, 6)).astype("float32")
    expected = serial.predict(x, batch_size=4, verbose=0)
    model = tnt.Model(serial, parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_pipeline_stages=2)
    try:
        got = model.predict(x, batch_size=4, verbose=0)
    except Exception as err:  # recorded: the test names it
        return {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    return {"diff": max_diff(expected, got), "rows": len(got)}


def unseeded_shuffle_check() -> dict:
    """NumPy inputs, fit's default shuffle=True, no global seed: stage 0 (reading x) and the
    last stage (reading y) must read the same samples in every micro-batch.

    Sample i is the one-hot e_i with target t_i = (i + 1) / n; stage 0 is a zero-initialised
    Dense(1) without bias, the last stage a weightless identity. One SGD step on a batch of
    b moves kernel[i] by lr * 2 t_j / b, with j the sample whose target the last stage paired
    with e_i. After one epoch the kernel is lr * 2 t / b iff every x met its own y (and each
    sample came once); stage 0 and the last stage drawing different orders break it.
    """
    # A user script: no global seed (the models above set one) and no op determinism
    # (which refuses unseeded random ops); TensorFlow has no public switch back.
    from tensorflow.python.framework import config as tf_config
    tf.random.set_seed(None)
    tf_config.disable_op_determinism()
    try:
        n, b, lr = 24, 6, 0.5
        x = np.eye(n, dtype="float32")
        t = ((np.arange(n) + 1) / n).astype("float32")[:, None]
        inp = keras.Input((n,), name="x")
        h = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", name="w")(inp)
        out = keras.layers.Activation("linear", name="same")(SplitLayer(name="cut")(h))
        model = tnt.Model(keras.Model(inp, out), parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                          num_pipeline_stages=2, num_micro_batches=2)
        model.compile(keras.optimizers.SGD(lr), "mse")
        model.fit(x, t, batch_size=b, epochs=1, verbose=0)  # shuffle=True, Keras' default
    finally:
        tf_config.enable_op_determinism()
    kernel = tnt_comm.broadcast_object(model.stage_model.get_weights()[0].ravel() if model.stage == 0 else None, 0)
    in_samples = kernel / (lr * 2 / b)  # the target each e_i was trained towards
    return {"each_x_met_its_y": bool(np.allclose(in_samples, t.ravel(), atol=1e-6)),
            "targets_met_x_n": [round(float(v) * n, 3) for v in in_samples]}


def main() -> None:
    args = sys.argv[1:]
    layout = args[args.index("--layout") + 1] if "--layout" in args else "pipelining"
    shared = Path(args[args.index("--shared") + 1]) if "--shared" in args else None
    sys.argv = [sys.argv[0], *args[:2]]
    out = _job.out_path()
    size = tnt.get_size()
    results: dict[str, dict] = {}
    extra: dict = {}
    if layout == "all":  # N = 2p ranks as 2 replicas
        strategy, p = tnt.ParallelStrategy.ALL, size // 2
        cases = {
            f"mlp_all{p}x2_adam_m4_gpipe": ("mlp", mlp, "adam", 4, "gpipe", 13, 13 * 2 + 4, 2),
            f"mlp_all{p}x2_adam_m4_1f1b": ("mlp", mlp, "adam", 4, "1f1b", 13, 13 * 2 + 4, 2),
            # remat="stages": bitwise the run that keeps its activations (shares its serial run)
            f"mlp_all{p}x2_adam_m4_1f1b_remat": ("mlp", mlp, "adam", 4, "1f1b+stages", 13, 13 * 2 + 4, 2),
        }
        if p == 2:
            # sparse gradients: micro-batch slices concatenated, then gathered over replicas
            cases[f"emb_all{p}x2_adam_m3_1f1b"] = ("emb", embedding_model, "adam", 3, "1f1b", 10, 10 * 3 + 3, 2)
            cases[f"lso_all{p}x2_lso_spe3_m3_1f1b"] = ("lso", lso_mlp, "lso", 3, "1f1b", 10, 10 * 7 + 3, 1, 3)
            cases[f"f16_all{p}x2_adam_m3_1f1b"] = ("f16", f16_mlp, "adam", 3, "1f1b", 10, 10 * 7 + 3, 2)
            # a weight the loss never reaches: no weight decay either (serial Keras skips it)
            cases[f"unused_all{p}x2_adamw_m2_1f1b"] = ("unused", unused_weight_model, "adamw", 2, "1f1b", 10,
                                                       10 * 2 + 3, 2)
    else:
        strategy, p = tnt.ParallelStrategy.PIPELINING, size
        cases = {
            f"skip_p{p}_adam_clip_m4_1f1b": ("skip", lambda: skip_model(p), "adam_clip", 4, "1f1b", 10, 10 * 3 + 2, 2),
        }
        if p == 2:  # SGD-momentum both schedules, one micro-batch (no pipelining), a CNN
            cases[f"mlp_p{p}_momentum_m3_gpipe"] = ("mlp", mlp, "sgd_momentum", 3, "gpipe", 11, 11 * 3 + 2, 2)
            cases[f"mlp_p{p}_momentum_m3_1f1b"] = ("mlp", mlp, "sgd_momentum", 3, "1f1b", 11, 11 * 3 + 2, 2)
            cases[f"mlp_p{p}_adam_m1_1f1b"] = ("mlp", mlp, "adam", 1, "1f1b", 10, 10 * 2 + 3, 2)
            cases[f"cnn_p{p}_momentum_m3_1f1b"] = ("cnn", cnn, "sgd_momentum", 3, "1f1b", 10, 10 * 3 + 2, 2)
            # sparse gradients (Embedding) with Adam: slices in micro-batch order, both schedules
            cases[f"emb_p{p}_adam_m4_gpipe"] = ("emb", embedding_model, "adam", 4, "gpipe", 10, 10 * 3 + 2, 2)
            cases[f"emb_p{p}_adam_m4_1f1b"] = ("emb", embedding_model, "adam", 4, "1f1b", 10, 10 * 3 + 2, 2)
            cases[f"emb_p{p}_adam_m4_gpipe_remat"] = ("emb", embedding_model, "adam", 4, "gpipe+stages", 10,
                                                      10 * 3 + 2, 2)
            # interleaved, virtual_stages=2: 4 chunks of the mlp, rank r holds chunks r, r + 2;
            # bitwise its 1F1B twin (2 stages cut elsewhere); the serial run of mlp_p2_adam_m1_1f1b;
            # the last batch of 3 rows: 3 micro-batches, no multiple of p (all forwards first)
            cases[f"mlp_p{p}_adam_m4_1f1b"] = ("mlp", mlp, "adam", 4, "1f1b", 10, 10 * 2 + 3, 2)
            cases[f"mlp_p{p}_adam_m4_interleaved"] = ("mlp", mlp, "adam", 4, "interleaved", 10, 10 * 2 + 3, 2)
            cases[f"lso_p{p}_lso_spe3_m3_1f1b"] = ("lso", lso_mlp, "lso", 3, "1f1b", 10, 10 * 7 + 3, 1, 3)
            # mixed_float16: compile wraps Adam in a LossScaleOptimizer; the last stage alone overflows
            cases[f"f16_p{p}_adam_m3_1f1b"] = ("f16", f16_mlp, "adam", 3, "1f1b", 10, 10 * 7 + 3, 2)
            cases[f"unused_p{p}_adamw_m2_1f1b"] = ("unused", unused_weight_model, "adamw", 2, "1f1b", 10,
                                                   10 * 2 + 3, 2)
        else:  # Adam both schedules on 3 stages
            cases[f"mlp_p{p}_adam_m4_gpipe"] = ("mlp", mlp, "adam", 4, "gpipe", 10, 10 * 3 + 3, 2)
            cases[f"mlp_p{p}_adam_m4_1f1b"] = ("mlp", mlp, "adam", 4, "1f1b", 10, 10 * 3 + 3, 2)
    for name, (kind, make, opt, m, schedule, batch, n, epochs, *spe) in cases.items():
        t0 = time.perf_counter()
        results[name] = run_case(kind, make, opt, strategy=strategy, p=p, m=m, schedule=schedule,
                                 batch=batch, n=n, epochs=epochs, spe=spe[0] if spe else 1)
        if tnt.is_master_rank():
            print(f"{name}: {time.perf_counter() - t0:.1f} s (serial fit {results[name]['seconds'][0]:.1f} s, "
                  f"pipelined fit {results[name]['seconds'][1]:.1f} s)", file=sys.stderr, flush=True)
    names = list(results)
    pairs = [(a, a.replace("_gpipe", "_1f1b")) for a in names if a.endswith("_gpipe")]
    extra["gpipe_equals_1f1b"] = {a: compare_schedules(results, a, b) for a, b in pairs if b in results}
    twins = [a for a in names if a.endswith("_remat")]
    if twins:
        extra["remat_equals_kept"] = {a: compare_schedules(results, a.removesuffix("_remat"), a) for a in twins}
    interleaved = [a for a in names if a.endswith("_interleaved")]
    if interleaved:
        extra["interleaved_equals_1f1b"] = {a: compare_serial_weights(results, a.replace("_interleaved", "_1f1b"), a)
                                            for a in interleaved}
    with tempfile.TemporaryDirectory(prefix="tnt-pipe-") as tmp_local:
        tmp = Path(tnt_comm.broadcast_object(tmp_local, 0))  # one directory for all ranks
        first = next(n for n in names if n.startswith("mlp") and ("1f1b" in n))
        if layout == "all" or size == 2:  # 3 ranks: no save/load (the others cover q = 2, 4)
            load_stages = [size, 2] if layout == "all" else [size, 1]
            extra["save_load"] = save_load_checks(results[first], strategy, p, tmp, load_stages,
                                                  shared if size == 2 else None)
        if interleaved:
            extra["interleaved_save_load"] = interleaved_save_load(results[interleaved[0]], tmp)
        if layout == "pipelining" and size == 3:
            if shared is not None and (shared / "p2.keras").exists():  # absent: the 2-rank job failed
                extra["load_p2_file"] = load_saved_at_p2(shared)
            extra["backup_resume"] = backup_resume_check(tmp)
        tnt_comm.barrier()
    if layout == "all" and p == 2:  # ALL 2 stages x 2 replicas with BatchNormalization
        extra["batch_norm_replicas"] = _replica_stats.one_model_after_fit(
            parallel_strategy=strategy, num_pipeline_stages=2, num_micro_batches=2)
    if layout == "pipelining" and size == 2:
        extra["validation_split_history_diff"] = validation_split_check()
        extra["predict_uncompiled"] = predict_uncompiled_check()
        extra["unseeded_shuffle"] = unseeded_shuffle_check()  # last: it unsets the global seed
    for r in results.values():
        r.pop("model")
        r.pop("ref")
    _job.write(out, {"ranks": size, "layout": layout, "cases": results, **extra,
                     "pid": os.getpid()})


if __name__ == "__main__":
    main()
