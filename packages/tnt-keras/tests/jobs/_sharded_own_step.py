"""Sharding levels 1-3 with a model's own ``train_step`` (jobs/sharded.py, the own_* cases).

One optimizer (Adam with an active global_clipnorm) on a regression model whose step is the
Keras guide's tape + ``apply_gradients``; and a GAN-like step with two optimizers (Adam for
the discriminator, SGD momentum for the generator; the noise comes with the data). Each runs
in serial Keras (the same class, one process) and on the launch's ranks with sharding=k:
History, weights, replicas bitwise alike, and each optimizer's slot elements per rank; at
level 3 (weights gathered per step) also the elements each rank stores between steps, a read
outside tnt's steps, and predict (the regression).
"""

from __future__ import annotations

import hashlib
import io
import tempfile
import zipfile

import _job
import h5py
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

EPOCHS, BATCH = 2, 10


class Regression(keras.Model):
    """Dense 16 -> 13 -> 7 -> 3 (uneven byte shares) with the guide's own train_step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = keras.Sequential([keras.Input((16,)), keras.layers.Dense(13, activation="tanh"),
                                      keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)])
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x, training=False):
        return self.body(x, training=training)

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


class SmallGAN(keras.Model):
    """examples/custom_train_step_gan.py in small: two optimizers, two loss trackers."""

    def __init__(self) -> None:
        super().__init__()
        self.discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="relu"),
                                               keras.layers.Dense(1, activation="sigmoid")])
        self.generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                           keras.layers.Dense(2)])
        self.d_tracker = keras.metrics.Mean(name="d_loss")
        self.g_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy()

    @property
    def metrics(self):
        return [self.d_tracker, self.g_tracker]

    def train_step(self, data):
        real, noise = data
        fake = self.generator(noise)
        points = tf.concat([fake, real], axis=0)
        labels = tf.concat([tf.ones_like(fake[:, :1]), tf.zeros_like(real[:, :1])], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(points))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros_like(fake[:, :1]), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_tracker.update_state(d_loss)
        self.g_tracker.update_state(g_loss)
        return {"d_loss": self.d_tracker.result(), "g_loss": self.g_tracker.result()}


def _elements(variables) -> int:
    return int(sum(np.prod(v.shape) for v in variables))


def _optimizers(model) -> dict:
    """Each optimizer and the variables its step applies it to."""
    if isinstance(model, SmallGAN):
        return {"d": (model.d_optimizer, model.discriminator.trainable_weights),
                "g": (model.g_optimizer, model.generator.trainable_weights)}
    return {"opt": (model.optimizer, model.trainable_variables)}


def _build(kind: str):
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(3)
    if kind == "gan":  # 46 samples: the last batch of 6 (uneven over 3 ranks)
        real = (rng.normal(size=(46, 2)) * 0.5 + [2.0, -1.0]).astype("float32")
        model, data = SmallGAN(), (real, rng.normal(size=(46, 4)).astype("float32"))
        model.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05, momentum=0.9))
        return model, data
    model = Regression()
    model.compile(keras.optimizers.Adam(0.01, global_clipnorm=0.05))
    return model, (rng.normal(size=(46, 16)).astype("float32"), rng.normal(size=(46, 3)).astype("float32"))


def _fit(model, data, callbacks=None):
    ds = tf.data.Dataset.from_tensor_slices(data).batch(BATCH)
    return model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=callbacks).history


class _StoredBetweenSteps(keras.callbacks.Callback):
    """Level 3: the trainable elements this rank's buffers hold after each step (read from the
    buffers, not the shapes: a freed variable's holds 0 elements), the largest seen."""

    def __init__(self, tm) -> None:
        super().__init__()
        self.tm, self.most = tm, 0

    def on_train_batch_end(self, batch, logs=None) -> None:
        shards = self.tm._tnt_sharding.per_step
        self.most = max(self.most, shards.stored_bytes(self.tm.model.trainable_variables) // 4)  # float32


_SERIAL: dict[str, tuple] = {}  # kind -> (serial model, its History): levels 1 and 2 share one (suite time)


def _serial(kind: str) -> tuple:
    if kind not in _SERIAL:
        serial, data = _build(kind)
        _SERIAL[kind] = (serial, _fit(serial, data))
    return _SERIAL[kind]


def own_step_case(level: int, kind: str) -> dict:
    """``kind``: "adam_clip" (one optimizer) or "gan" (two) at sharding=``level``, against serial Keras."""
    serial, serial_history = _serial(kind)
    model, data = _build(kind)
    tm = tnt.Model(model, sharding=level)
    tm.compile(*([model.d_optimizer, model.g_optimizer] if kind == "gan" else [model.optimizer]))
    stored = _StoredBetweenSteps(tm) if level == 3 else None
    history = _fit(tm, data, [stored] if stored else None)
    h = hashlib.sha256()
    for w in tm.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    mine, theirs = _optimizers(model), _optimizers(serial)
    out = level_3(tm, serial, data, stored) if level == 3 else {}
    return out | {
        "digest": h.hexdigest(),
        "history_diff": max(_job.max_abs_diff(history[k], serial_history[k]) for k in serial_history),
        "history_keys": sorted(history),
        "weight_diff": _job.max_abs_diff(tm.get_weights(), serial.get_weights()),
        "replicas_identical": len(set(tnt_comm.allgather_object(h.hexdigest()))) == 1,
        # Per optimizer: its slot and scalar elements on each rank, serial Keras' and the
        # elements of the variables it updates; steps applied (rank, serial).
        "optimizers": {name: {
            "slot_elements_per_rank": tnt_comm.allgather_object(_elements(opt.variables)),
            "serial_slot_elements": _elements(theirs[name][0].variables),
            "variable_elements": _elements(variables),
            "applied_steps": [int(opt.iterations.numpy()), int(theirs[name][0].iterations.numpy())],
        } for name, (opt, variables) in mine.items()},
        "steps": EPOCHS * -(-len(data[0]) // BATCH),
        "initial_gradient_norm": initial_gradient_norm() if kind == "adam_clip" else None,
        **(_file_round_trip(tm, model, serial) if kind == "gan" else {}),
    }


def _file_entries(path: str) -> dict:
    """Every array of a ``.keras`` file's weights store, by its path (layers and optimizers)."""
    out: dict = {}
    with zipfile.ZipFile(path) as z, h5py.File(io.BytesIO(z.read("model.weights.h5")), "r") as f:
        f.visititems(lambda name, o: out.__setitem__(name, np.array(o)) if isinstance(o, h5py.Dataset) else None)
    return out


def _file_round_trip(tm, model, serial) -> dict:
    """``save`` of the sharded GAN against serial Keras' own file (both optimizers' whole
    state under ``d_optimizer`` / ``g_optimizer``), then ``load_weights`` of it back into the
    sharded optimizers (their owned slots zeroed first)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = tnt_comm.broadcast_object(tmp if tnt.is_master_rank() else None, 0)
        tm.save(f"{folder}/tnt.keras")
        out: dict = {}
        if tnt.is_master_rank():
            serial.save(f"{folder}/serial.keras")
            mine, theirs = _file_entries(f"{folder}/tnt.keras"), _file_entries(f"{folder}/serial.keras")
            optimizer_keys = sorted(k for k in theirs if "optimizer" in k.split("/")[0])
            out["file_same_entries"] = sorted(mine) == sorted(theirs)
            out["file_optimizer_entries"] = len(optimizer_keys)
            out["file_diff"] = max(_job.max_abs_diff(mine[k], theirs[k]) for k in theirs if k in mine)
        slots = [v for opt in (model.d_optimizer, model.g_optimizer) for v in opt.variables]
        held = [v.numpy().copy() for v in slots]
        for v in slots:
            v.assign(np.zeros(v.shape, v.dtype))
        model.built = True  # no call(): Keras refuses load_weights into an unbuilt model, serially too
        tm.load_weights(f"{folder}/tnt.keras")
        out["reloaded_slots_diff"] = max(tnt_comm.allgather_object(
            _job.max_abs_diff([v.numpy() for v in slots], held)))
        tnt_comm.barrier()
    return tnt_comm.broadcast_object(out if tnt.is_master_rank() else None, 0)


def level_3(tm, serial, data, stored: _StoredBetweenSteps) -> dict:
    """Level 3 of an own train_step (weights gathered per step): what each rank's buffers
    hold between steps (during fit and after it) against what it owns, a read outside tnt's
    steps, and predict against serial Keras."""
    variables = tm.model.trainable_variables
    try:
        tm.model.get_weights()
        read = "no error"
    except Exception as e:  # the type and message are what is checked
        read = f"{type(e).__name__}: {e}"
    out = {
        "stored_elements_per_rank": tnt_comm.allgather_object(
            [stored.most, tm._tnt_sharding.per_step.stored_bytes(variables) // 4]),  # float32
        "owned_elements_per_rank": tnt_comm.allgather_object(_elements(tm._tnt_sharding.owned_variables())),
        "variable_elements": _elements(variables),
        "read_outside_a_step": read[:400],
    }
    if not isinstance(serial, SmallGAN):  # the GAN has no call of its own
        x = data[0]
        out["predict_diff"] = _job.max_abs_diff(tm.predict(x, batch_size=BATCH, verbose=0),
                                                serial.predict(x, batch_size=BATCH, verbose=0))
    return out


def initial_gradient_norm() -> float:
    """The global norm of the regression's first-step gradient (clipnorm 0.05 must be below it)."""
    model, (x, y) = _build("adam_clip")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x[:BATCH]) - y[:BATCH]))
    return float(tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables)))


OWN_STEP_CASES = {"own_l1_adam_clip": (1, "adam_clip"), "own_l2_adam_clip": (2, "adam_clip"), "own_l2_gan": (2, "gan"),
                  "own_l3_adam_clip": (3, "adam_clip"), "own_l3_gan": (3, "gan")}
