"""Every way a Keras user trains, on N ranks against plain serial Keras in the same job.

Custom train/test/predict steps (a GAN with two optimizers, a tracked model with its own
test and predict steps), custom training loops, global batches smaller than the number
of ranks, shuffled NumPy inputs, and the rest of the Model API (uncompiled inference,
class_weight, *_on_batch, multi-output losses, export, batch-norm statistics).

Each check records its largest difference to serial (``diff``) and its tolerance; rank 0
writes them and tests/test_keras_api.py asserts each by name.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import _job
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm
import tnt_data

TOL_LOSS = 1e-5
TOL_WEIGHTS = 2e-5
CHECKS: dict[str, dict] = {}


def check(name: str, ok: bool, detail: object = "", diff: float | None = None) -> None:
    CHECKS[name] = {"ok": bool(ok), "detail": str(detail)[:2000], "diff": diff}


def close(name: str, diff: float, tol: float, detail: object = "") -> None:
    check(name, diff <= tol, f"max abs diff {diff:.3g} (tol {tol:g}) {detail}", diff)


def same_on_all_ranks(arrays) -> bool:
    mine = [np.asarray(a).tobytes() for a in arrays]
    return all(theirs == mine for theirs in tnt_comm.allgather_object(mine))


@contextlib.contextmanager
def recorded(name: str):
    """Record an exception as a failed check instead of ending the job."""
    try:
        yield
    except Exception as err:
        check(name, False, f"{type(err).__name__}: {err}")


def rng_data(n: int, features: int, seed: int, classes: int = 3):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, size=n).astype("int32")
    x = (rng.normal(size=(n, features)) + y[:, None] * 0.4).astype("float32")
    return x, y


# -- 1. a GAN with its own train_step and two optimizers --------------------------------
LATENT = 3


class GAN(keras.Model):
    """The Keras guide's GAN, with the latent noise fed through the data (reproducible)."""

    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.steps_run = tf.Variable(0, trainable=False, dtype=tf.int64)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, data):
        real, noise = data
        fake = self.generator(noise)
        combined = tf.concat([fake, real], axis=0)
        labels = tf.concat([tf.ones_like(real[:, :1]), tf.zeros_like(real[:, :1])], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros_like(real[:, :1]), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        self.steps_run.assign_add(1)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def gan(seed: int) -> GAN:
    keras.utils.set_random_seed(seed)
    disc = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1, activation="sigmoid")])
    gen = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Dense(4)])
    model = GAN(disc, gen)
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.BinaryCrossentropy())
    return model


def check_gan(batch: int) -> None:
    rng = np.random.default_rng(3)
    real = rng.normal(size=(40, 4)).astype("float32")
    noise = rng.normal(size=(40, LATENT)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((real, noise)).batch(batch)  # 40 % 11 = 7
    serial = gan(11)
    h_serial = serial.fit(data, epochs=2, verbose=0).history
    model = tnt.Model(gan(11))
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.BinaryCrossentropy())
    h = model.fit(data, epochs=2, verbose=0).history
    close("gan_history", _job.history_diff(h_serial, h), TOL_LOSS, h)
    weights = model.model.discriminator.get_weights() + model.model.generator.get_weights()
    close("gan_weights_both_submodels", _job.max_abs_diff(
        serial.discriminator.get_weights() + serial.generator.get_weights(), weights), TOL_WEIGHTS)
    close("gan_trackers", _job.max_abs_diff(
        [serial.d_loss_tracker.result(), serial.g_loss_tracker.result()],
        [model.model.d_loss_tracker.result(), model.model.g_loss_tracker.result()]), TOL_LOSS)
    steps = int(model.model.steps_run.numpy())
    check("gan_custom_step_called", steps == int(serial.steps_run.numpy()) == 8, f"steps {steps}")
    check("gan_replicas_identical", same_on_all_ranks(weights))


# -- 2. a tracked model with its own train, test and predict steps ----------------------
class Tracked(keras.Model):
    """Halves its gradients by hand, tracks an extra loss, evaluates and predicts its way."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(12, activation="tanh")
        self.out = keras.layers.Dense(3, activation="softmax")
        self.extra_tracker = keras.metrics.Mean(name="extra")
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.eval_tracker = keras.metrics.Mean(name="eval_extra")

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            extra = 0.1 * tf.reduce_mean(tf.square(self.hidden(x)))
            total = loss + extra
        grads = tape.gradient(total, self.trainable_variables)
        self.optimizer.apply_gradients(zip([0.5 * g for g in grads], self.trainable_variables))
        self.loss_tracker.update_state(total)
        self.extra_tracker.update_state(extra)
        for metric in self.metrics:
            if metric.name == "compile_metrics":
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics if m.name != "eval_extra"}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.eval_tracker.update_state(tf.reduce_mean(tf.square(y_pred)))
        self.loss_tracker.update_state(self.compute_loss(x=x, y=y, y_pred=y_pred))
        return {"loss": self.loss_tracker.result(), "eval_extra": self.eval_tracker.result()}

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return 2.0 * self(x, training=False)


def tracked(seed: int) -> Tracked:
    keras.utils.set_random_seed(seed)
    model = Tracked()
    model(tf.zeros((1, 10)))
    return model


def check_tracked(batch: int) -> None:
    x, y = rng_data(37, 10, 4)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    compile_args = dict(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    serial = tracked(12)
    serial.compile(keras.optimizers.SGD(0.05, momentum=0.9), **compile_args)
    h_serial = serial.fit(data, epochs=2, verbose=0).history
    model = tnt.Model(tracked(12))
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), **compile_args)
    h = model.fit(data, epochs=2, verbose=0).history
    close("tracked_history", _job.history_diff(h_serial, h), TOL_LOSS, h)
    close("tracked_weights", _job.max_abs_diff(serial.get_weights(), model.get_weights()), TOL_WEIGHTS)
    e_serial = serial.evaluate(data, verbose=0, return_dict=True)
    e = model.evaluate(data, verbose=0, return_dict=True)
    check("custom_test_step_used", "eval_extra" in e, e)
    close("custom_test_step_equal", _job.max_abs_diff(
        [e_serial[k] for k in sorted(e_serial)], [e[k] for k in sorted(e_serial)]), TOL_LOSS, e)
    p_serial = serial.predict(x, batch_size=batch, verbose=0)
    p = model.predict(x, batch_size=batch, verbose=0)
    close("custom_predict_step_equal", _job.max_abs_diff(p_serial, p), TOL_WEIGHTS,
          f"rows {len(p)}")


# -- 3. custom training loops -----------------------------------------------------------
def dense(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(12, activation="tanh"),
                             keras.layers.Dense(3, activation="softmax")])


def _loop(model, optimizer, dataset, weighted: bool) -> None:
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if weighted:
            with tnt.local_batch_size(tf.shape(x)[0]):
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
        else:
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(2):
        for x, y in dataset:
            step(x, y)


def check_custom_loops() -> None:
    size, rank = tnt.get_size(), tnt.get_rank()
    for name, batch, weighted in (("equal_batches", 6 * size, False), ("weighted", 7, True)):
        x, y = rng_data(42 if not weighted else 40, 10, 5)
        global_batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        serial = dense(13)
        _loop(serial, keras.optimizers.Adam(0.01), global_batches, weighted=False)
        model = tnt.Model(dense(13))
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
        mine = tnt_data.distribute(global_batches, rank=rank, size=size)
        _loop(model, model.optimizer, mine, weighted)
        close(f"custom_loop_{name}", _job.max_abs_diff(serial.get_weights(), model.get_weights()),
              TOL_WEIGHTS)
        check(f"custom_loop_{name}_replicas_identical", same_on_all_ranks(model.get_weights()))
    # an optimizer the user made, not the compiled one, is reduced as well
    x, y = rng_data(24, 10, 6)
    model = tnt.Model(dense(14))
    mine = tnt_data.distribute(tf.data.Dataset.from_tensor_slices((x, y)).batch(4 * size),
                               rank=rank, size=size)
    _loop(model, keras.optimizers.SGD(0.1), mine, weighted=False)
    check("custom_loop_own_optimizer_replicas_identical", same_on_all_ranks(model.get_weights()))


# -- 3b. sparse gradients (an Embedding) in a custom train_step and a custom loop -------
class EmbeddingStep(keras.Model):
    """An Embedding under its own train_step: the lookup's gradient is a tf.IndexedSlices,
    which serial Keras' Adam applies as slices (repeated rows counted per slice)."""

    def __init__(self):
        super().__init__()
        self.emb = keras.layers.Embedding(8, 4)
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, ids, training=False):
        return self.out(self.pool(self.emb(ids)))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def token_data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n).astype("int32")
    return ((rng.integers(0, 6, size=(n, 6)) + y[:, None]) % 8).astype("int32"), y


def embedding_step_model(seed: int) -> EmbeddingStep:
    keras.utils.set_random_seed(seed)
    model = EmbeddingStep()
    model(tf.zeros((1, 6), tf.int32))
    return model


def check_sparse_custom_steps() -> None:
    size, rank = tnt.get_size(), tnt.get_rank()
    x, y = token_data(31, 17)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(7)  # last batch 3: uneven on 2 and 3 ranks
    serial = embedding_step_model(15)
    serial.compile(keras.optimizers.Adam(0.02), "sparse_categorical_crossentropy")
    serial.fit(data, epochs=2, verbose=0)
    model = tnt.Model(embedding_step_model(15))
    model.compile(keras.optimizers.Adam(0.02), "sparse_categorical_crossentropy")
    model.fit(data, epochs=2, verbose=0)
    close("sparse_custom_train_step_adam", _job.max_abs_diff(serial.get_weights(), model.get_weights()),
          TOL_WEIGHTS)
    serial = embedding_step_model(16)
    _loop(serial, keras.optimizers.Adam(0.02), data, weighted=False)
    model = tnt.Model(embedding_step_model(16))
    model.compile(keras.optimizers.Adam(0.02), "sparse_categorical_crossentropy")
    _loop(model, model.optimizer, tnt_data.distribute(data, rank=rank, size=size), weighted=True)
    close("sparse_custom_loop_adam", _job.max_abs_diff(serial.get_weights(), model.get_weights()),
          TOL_WEIGHTS)
    check("sparse_custom_loop_adam_replicas_identical", same_on_all_ranks(model.get_weights()))


# -- 4. global batches smaller than the number of ranks ---------------------------------
def check_small_batches() -> None:
    x, y = rng_data(5, 10, 7)
    worst, steps_ok, detail = 0.0, True, []
    for batch in (1, 2, 4):
        for drop in (False, True):
            for split in ("after_batch", "early"):
                ds = tf.data.Dataset.from_tensor_slices((x, y))
                if split == "early":  # a 1:1 map before the batch: tnt_data may split early
                    ds = ds.map(lambda a, b: (a * 1.0, b))
                ds = ds.batch(batch, drop_remainder=drop)
                serial = dense(15)
                serial.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
                h_serial = serial.fit(ds, epochs=1, verbose=0).history
                model = tnt.Model(dense(15))
                model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
                h = model.fit(ds, epochs=1, verbose=0).history
                steps = int(model.optimizer.iterations.numpy())
                all_steps = tnt_comm.allgather_object(steps)
                steps_ok &= len(set(all_steps)) == 1 and steps == int(serial.optimizer.iterations.numpy())
                d = max(_job.history_diff(h_serial, h),
                        _job.max_abs_diff(serial.get_weights(), model.get_weights()))
                worst = max(worst, d)
                detail.append(f"B={batch} drop={drop} {split}: steps {all_steps} diff {d:.2g}")
    close("small_global_batches_equal_serial", worst, TOL_WEIGHTS, "; ".join(detail))
    check("small_global_batches_same_steps", steps_ok, "; ".join(detail))


# -- 5. shuffled NumPy inputs -------------------------------------------------------------
def check_shuffled_arrays() -> None:
    x, y = rng_data(50, 10, 8)
    results = []
    for wrap in (False, True):
        keras.utils.set_random_seed(21)
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(12, activation="tanh"),
                                  keras.layers.Dense(3, activation="softmax")])
        if wrap:
            model = tnt.Model(model)
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0).history  # shuffle=True
        results.append((history, model.get_weights()))
    (h_serial, w_serial), (h, w) = results
    close("shuffled_arrays_equal_serial_script",
          max(_job.history_diff(h_serial, h), _job.max_abs_diff(w_serial, w)), TOL_WEIGHTS)


def check_unseeded_shuffle_uses_each_sample_once() -> None:
    """Without any global seed, Keras' default shuffle=True must still give every sample
    exactly once per epoch across the ranks (one global order, not one per rank).

    Sample i is the one-hot vector e_i with target 1, the kernel starts at 0 and there is
    no bias: one SGD step on a batch holding sample i k times moves kernel[i] by k times
    the same amount, so after one epoch every entry is equal iff each sample came once."""
    # A user script: no global seed (earlier checks set one) and no op determinism (which
    # would refuse unseeded random ops); TensorFlow has no public switch back.
    from tensorflow.python.framework import config as tf_config
    tf.random.set_seed(None)
    tf_config.disable_op_determinism()
    try:
        _train_one_hot_epoch()
    finally:
        tf_config.enable_op_determinism()


def _train_one_hot_epoch() -> None:
    n = 24
    x, y = np.eye(n, dtype="float32"), np.ones((n, 1), "float32")
    model = tnt.Model(keras.Sequential([keras.Input((n,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros")]))
    model.compile(keras.optimizers.SGD(0.5), "mse")
    model.fit(x, y, batch_size=6, epochs=1, verbose=0)  # shuffle=True, Keras' default
    kernel = model.get_weights()[0].ravel()
    expected = 0.5 * 2.0 / 6  # lr * d(mse)/dw for one sample of a batch of 6, from w = 0
    check("unseeded_shuffle_each_sample_once_per_epoch",
          bool(np.allclose(kernel, expected, atol=1e-6)),
          f"kernel entries {np.round(kernel / expected, 3).tolist()} (in steps of one sample)")


# -- 6. the rest of the Model API ---------------------------------------------------------
def check_uncompiled_inference(tmp: Path) -> None:
    x, _ = rng_data(23, 10, 9)
    serial = dense(16)
    with recorded("predict_uncompiled"):
        p = tnt.Model(dense(16)).predict(x, batch_size=5, verbose=0)
        close("predict_uncompiled", _job.max_abs_diff(serial.predict(x, batch_size=5, verbose=0), p),
              TOL_WEIGHTS)
    with recorded("load_model_compile_false_predict"):
        path = tmp / "plain.keras"
        if tnt.is_master_rank():
            serial.save(path)
        tnt_comm.barrier()
        loaded = tnt.models.load_model(path, compile=False)
        close("load_model_compile_false_predict",
              _job.max_abs_diff(serial.predict(x, verbose=0), loaded.predict(x, verbose=0)), TOL_WEIGHTS)
    with recorded("evaluate_without_optimizer"):
        x2, y2 = rng_data(23, 10, 9)
        serial.compile(optimizer=None, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        model = tnt.Model(dense(16))
        model.compile(optimizer=None, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        close("evaluate_without_optimizer", _job.max_abs_diff(
            serial.evaluate(x2, y2, batch_size=5, verbose=0), model.evaluate(x2, y2, batch_size=5, verbose=0)),
            TOL_LOSS)


def check_class_weight() -> None:
    x, y = rng_data(33, 10, 10)
    weights = {0: 1.0, 1: 2.5, 2: 0.5}
    with recorded("class_weight_equal_serial"):
        serial = dense(17)
        serial.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
        h_serial = serial.fit(x, y, batch_size=7, epochs=2, class_weight=weights, shuffle=False, verbose=0).history
        model = tnt.Model(dense(17))
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
        h = model.fit(x, y, batch_size=7, epochs=2, class_weight=weights, shuffle=False, verbose=0).history
        close("class_weight_equal_serial", max(_job.history_diff(h_serial, h),
              _job.max_abs_diff(serial.get_weights(), model.get_weights())), TOL_WEIGHTS)


@keras.saving.register_keras_serializable("tnt_tests")
class WithUnusedWeight(keras.layers.Layer):
    """A layer holding a weight its call never reads (serial Keras' optimizer skips it)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3), name="kernel")
        self.unused = self.add_weight(shape=(4,), initializer="ones", name="unused")

    def call(self, x):
        return x @ self.kernel


def check_weight_decay_without_gradient() -> None:
    """AdamW's weight decay moves only the weights the loss reaches, as in serial Keras
    (tnt exchanged a zero gradient for the unread weight and the decay moved it by 8e-3)."""
    x, y = rng_data(33, 10, 12)

    def build():
        keras.utils.set_random_seed(6)
        inp = keras.Input((10,))
        out = WithUnusedWeight()(keras.layers.Dense(8, activation="relu")(inp))
        return keras.Model(inp, keras.layers.Activation("softmax")(out))

    with recorded("weight_decay_skips_weights_without_gradient"):
        serial = build()
        serial.compile(keras.optimizers.AdamW(0.01, weight_decay=0.1), "sparse_categorical_crossentropy")
        serial.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
        model = tnt.Model(build())
        model.compile(keras.optimizers.AdamW(0.01, weight_decay=0.1), "sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
        unused = float(np.max(np.abs(model.get_weights()[3] - 1.0)))  # the unread weight, initially ones
        check("weight_decay_skips_weights_without_gradient",
              _job.max_abs_diff(serial.get_weights(), model.get_weights()) <= TOL_WEIGHTS and unused == 0.0,
              f"unread weight moved by {unused}", _job.max_abs_diff(serial.get_weights(), model.get_weights()))


def check_on_batch() -> None:
    x, y = rng_data(11, 10, 11)
    with recorded("on_batch_equal_serial"):
        serial = dense(18)
        serial.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
        model = tnt.Model(dense(18))
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
        diffs = []
        for _ in range(3):
            diffs.append(_job.max_abs_diff(serial.train_on_batch(x, y), model.train_on_batch(x, y)))
        diffs.append(_job.max_abs_diff(serial.get_weights(), model.get_weights()))
        diffs.append(_job.max_abs_diff(serial.test_on_batch(x, y), model.test_on_batch(x, y)))
        diffs.append(_job.max_abs_diff(serial.predict_on_batch(x), model.predict_on_batch(x)))
        close("on_batch_equal_serial", max(diffs), TOL_WEIGHTS, diffs)


#: scaled gradients near float32's limit: serial Keras applies every step of this case; a
#: rank's gradient times its micro-batch size overflowed (2 of 8 steps skipped on 2 ranks)
SCALE = 2.0**127


class ScaledStep(keras.Sequential):
    """An own train_step with loss scaling, as Keras' guide writes it: scale_loss, then
    apply (the LossScaleOptimizer unscales and skips non-finite steps)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            scaled = self.optimizer.scale_loss(loss)
        self.optimizer.apply(tape.gradient(scaled, self.trainable_variables), self.trainable_variables)
        return self.compute_metrics(x, y, self(x, training=False))


def scaled_step_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = ScaledStep([keras.Input((10,)), keras.layers.Dense(12, activation="tanh"),
                        keras.layers.Dense(3, activation="softmax")])
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=SCALE),
                  "sparse_categorical_crossentropy")
    return model


def check_own_step_loss_scale() -> None:
    """Each rank's scaled gradient fits float32 where serial Keras' does: weighting it by its
    micro-batch size before the sum must not overflow it into a skipped step."""
    x, y = rng_data(80, 10, 21)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    with recorded("own_step_loss_scale_equal_serial"):
        serial = scaled_step_model(31)
        serial.fit(data, epochs=1, verbose=0)
        model = tnt.Model(scaled_step_model(31))
        model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=SCALE),
                      "sparse_categorical_crossentropy")
        model.fit(data, epochs=1, verbose=0)
        applied = [int(serial.optimizer.inner_optimizer.iterations), int(model.model.optimizer.inner_optimizer.iterations)]
        check("own_step_loss_scale_same_steps_applied", applied[0] == applied[1] and applied[0] > 0,
              f"steps applied serial, tnt: {applied} of 8")
        close("own_step_loss_scale_equal_serial", _job.max_abs_diff(serial.get_weights(), model.get_weights()),
              TOL_WEIGHTS, f"scale serial {float(serial.optimizer.dynamic_scale)}, tnt {float(model.model.optimizer.dynamic_scale)}")


def check_user_distributed_loss_scale() -> None:
    """tnt's default step on data each rank brings itself (``tnt_distribute_dataset=False``):
    the global batch is known only by summing the ranks' sizes, which must happen before
    backprop, or a rank's loss-scaled gradient weighted by its size overflows where serial
    Keras' fits (Note [Global batch first]; 1 of 8 steps skipped before)."""
    x, y = rng_data(80, 10, 21)
    rank, size = tnt.get_rank(), tnt.get_size()
    # rank r's rows of each global batch of 10, as tnt's own split would give them
    rows = np.concatenate([np.arange(b * 10, b * 10 + 10)[rank::size] for b in range(8)])
    mine = tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(len(range(rank, 10, size)))
    with recorded("user_distributed_loss_scale_equal_serial"):
        keras.utils.set_random_seed(31)
        serial = keras.Sequential([keras.Input((10,)), keras.layers.Dense(12, activation="tanh"),
                                   keras.layers.Dense(3, activation="softmax")])
        model = tnt.Model(keras.models.clone_model(serial))
        model.model.set_weights(serial.get_weights())
        for m in (serial, model):
            m.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=SCALE),
                      "sparse_categorical_crossentropy")
        serial.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(10), epochs=1, verbose=0)
        model.fit(mine, epochs=1, verbose=0, tnt_distribute_dataset=False)
        applied = [int(serial.optimizer.inner_optimizer.iterations), int(model.model.optimizer.inner_optimizer.iterations)]
        check("user_distributed_loss_scale_same_steps_applied", applied[0] == applied[1] and applied[0] > 0,
              f"steps applied serial, tnt: {applied} of 8")
        close("user_distributed_loss_scale_equal_serial",
              _job.max_abs_diff(serial.get_weights(), model.get_weights()), TOL_WEIGHTS,
              f"scale serial {float(serial.optimizer.dynamic_scale)}, tnt {float(model.model.optimizer.dynamic_scale)}")


def two_outputs(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((10,))
    h = keras.layers.Dense(12, activation="tanh")(inp)
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(h)
    return keras.Model(inp, {"cls": cls, "reg": reg})


def check_multi_output() -> None:
    x, y = rng_data(31, 10, 12)
    targets = {"cls": y, "reg": x[:, :1] * 2.0}
    compile_args = dict(loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                        loss_weights={"cls": 1.0, "reg": 0.3})
    with recorded("multi_output_per_output_losses"):
        serial = two_outputs(19)
        serial.compile(keras.optimizers.SGD(0.05), **compile_args)
        h_serial = serial.fit(x, targets, batch_size=7, shuffle=False, epochs=2, verbose=0).history
        model = tnt.Model(two_outputs(19))
        model.compile(keras.optimizers.SGD(0.05), **compile_args)
        h = model.fit(x, targets, batch_size=7, shuffle=False, epochs=2, verbose=0).history
        e_serial = serial.evaluate(x, targets, batch_size=7, verbose=0, return_dict=True)
        e = model.evaluate(x, targets, batch_size=7, verbose=0, return_dict=True)
        close("multi_output_per_output_losses", max(
            _job.history_diff(h_serial, h),
            _job.max_abs_diff([e_serial[k] for k in sorted(e_serial)], [e[k] for k in sorted(e_serial)])),
            TOL_LOSS, {"history": h, "evaluate": e})


def check_export(tmp: Path) -> None:
    x, y = rng_data(20, 10, 13)
    with recorded("export_serves_serial_outputs"):
        model = tnt.Model(dense(20))
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=5, epochs=1, verbose=0, shuffle=False)
        serial = dense(20)
        serial.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        serial.fit(x, y, batch_size=5, epochs=1, verbose=0, shuffle=False)
        path = tmp / "exported"
        model.export(str(path), verbose=False)
        loaded = tf.saved_model.load(str(path))  # keep a reference while serving
        served = loaded.serve(tf.constant(x))
        close("export_serves_serial_outputs", _job.max_abs_diff(serial.predict(x, verbose=0), served),
              TOL_WEIGHTS, f"written by master only: {sorted(p.name for p in tmp.iterdir())}")


def check_batch_norm(tmp: Path) -> None:
    x, y = rng_data(48, 10, 14)
    with recorded("batch_norm_statistics_identical"):
        keras.utils.set_random_seed(22)
        model = tnt.Model(keras.Sequential([
            keras.Input((10,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
            keras.layers.Dense(3, activation="softmax")]))
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        stats = [v.numpy() for v in model.model.layers[1].non_trainable_variables]
        check("batch_norm_statistics_identical", same_on_all_ranks(stats))
        path = tmp / "bn.weights.h5"
        model.save_weights(path)
        reference = keras.models.clone_model(model.model)
        reference.load_weights(path)
        saved = [v.numpy() for v in reference.layers[1].non_trainable_variables]
        close("batch_norm_saved_file_holds_common_statistics", _job.max_abs_diff(stats, saved), 0.0)


def check_unknown_cardinality() -> None:
    """A dataset whose length TensorFlow cannot tell (filter): logs must still be global."""
    x, y = rng_data(29, 10, 15)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(6)
    with recorded("unknown_cardinality_logs"):
        serial = dense(23)
        serial.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
        h_serial = serial.fit(ds, epochs=2, verbose=0).history
        e_serial = serial.evaluate(ds, verbose=0)
        model = tnt.Model(dense(23))
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
        h = model.fit(ds, epochs=2, verbose=0).history
        close("unknown_cardinality_logs", max(_job.history_diff(h_serial, h),
              _job.max_abs_diff(e_serial, model.evaluate(ds, verbose=0))), TOL_LOSS, h)


def bn_branches(seed: int, layer=keras.layers.BatchNormalization) -> keras.Model:
    """Two normalised branches that could run in parallel (as in a ResNet shortcut)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((10,))
    a = layer()(keras.layers.Dense(8)(inp))
    b = layer()(keras.layers.Dense(8)(inp))
    h = keras.layers.Activation("tanh")(keras.layers.Add()([a, b]))
    return keras.Model(inp, keras.layers.Dense(3, activation="softmax")(h))


def check_sync_batch_norm() -> None:
    x, y = rng_data(45, 10, 16)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(11)  # 45 % 11 = 1
    compile_args = dict(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    serial = bn_branches(24)
    serial.compile(keras.optimizers.SGD(0.05, momentum=0.9), **compile_args)
    h_serial = serial.fit(ds, epochs=2, verbose=0).history
    e_serial = serial.evaluate(ds, verbose=0)
    for name, make in (("option", lambda: tnt.Model(bn_branches(24), sync_batch_norm=True)),
                       ("layer", lambda: tnt.Model(bn_branches(24, tnt.keras.layers.SyncBatchNormalization)))):
        with recorded(f"sync_batch_norm_{name}_equal_serial"):
            model = make()
            model.compile(keras.optimizers.SGD(0.05, momentum=0.9), **compile_args)
            h = model.fit(ds, epochs=2, verbose=0).history
            diff = max(_job.history_diff(h_serial, h),
                       _job.max_abs_diff(serial.get_weights(), model.get_weights()),
                       _job.max_abs_diff(e_serial, model.evaluate(ds, verbose=0)))
            close(f"sync_batch_norm_{name}_equal_serial", diff, TOL_WEIGHTS, h)
    with recorded("sync_batch_norm_float64_equal_serial"):  # every float dtype (issue 27)
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy("float64")
        try:
            ds64 = tf.data.Dataset.from_tensor_slices((x.astype("float64"), y)).batch(11)
            serial64 = bn_branches(24)
            serial64.compile(keras.optimizers.SGD(0.05, momentum=0.9), **compile_args)
            h_serial64 = serial64.fit(ds64, epochs=2, verbose=0).history
            model = tnt.Model(bn_branches(24), sync_batch_norm=True)
            model.compile(keras.optimizers.SGD(0.05, momentum=0.9), **compile_args)
            h = model.fit(ds64, epochs=2, verbose=0).history
            diff = max(_job.history_diff(h_serial64, h),
                       _job.max_abs_diff(serial64.get_weights(), model.get_weights()))
            dtypes = sorted({w.dtype.name for w in model.get_weights()})
            check("sync_batch_norm_float64_equal_serial", diff <= TOL_WEIGHTS and dtypes == ["float64"],
                  f"max abs diff {diff:.3g}, weights {dtypes}")
        finally:
            keras.config.set_dtype_policy(previous)
    with recorded("sync_batch_norm_layer_loads_as_plain_bn"):
        config = tnt.keras.layers.SyncBatchNormalization(momentum=0.9).get_config()
        plain = keras.layers.BatchNormalization.from_config(config)
        check("sync_batch_norm_layer_loads_as_plain_bn", plain.momentum == 0.9, config)


def check_errors() -> None:
    try:
        tnt.Model(dense(1), tnt_micro_batch_size=4)
        check("unknown_model_kwarg_error", False, "no error")
    except TypeError as err:
        check("unknown_model_kwarg_error", "tnt_micro_batch_size" in str(err), err)


def main() -> None:
    out = _job.out_path()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tnt_comm.broadcast_object(tmp_dir if tnt.is_master_rank() else None, 0))
        steps = {
            "gan": lambda: check_gan(11), "tracked": lambda: check_tracked(7),
            "custom_loops": check_custom_loops, "sparse_custom_steps": check_sparse_custom_steps,
            "small_batches": check_small_batches,
            "shuffled_arrays": check_shuffled_arrays,
            "unseeded_shuffle": check_unseeded_shuffle_uses_each_sample_once,
            "uncompiled": lambda: check_uncompiled_inference(tmp),
            "class_weight": check_class_weight, "on_batch": check_on_batch,
            "own_step_loss_scale": check_own_step_loss_scale,
            "user_distributed_loss_scale": check_user_distributed_loss_scale,
            "weight_decay": check_weight_decay_without_gradient,
            "multi_output": check_multi_output, "export": lambda: check_export(tmp),
            "batch_norm": lambda: check_batch_norm(tmp), "errors": check_errors,
            "unknown_cardinality": check_unknown_cardinality,
            "sync_batch_norm": check_sync_batch_norm,
        }
        for name, fn in steps.items():
            with recorded(f"job_step_{name}"):
                fn()
        tnt_comm.barrier()
    _job.write(out, {"ranks": tnt.get_size(), "checks": CHECKS})


if __name__ == "__main__":
    main()
