"""Serial-equivalence job: every case trains a model with plain Keras (serial reference,
computed once, by one of the ranks: the references are shared out, jobs/_serial_refs.py) and with tnt.Model on all ranks, from the same initial weights
on the same global batches, and records the largest differences.

Cases cover the optimizers, a dense net, a LeNet-like CNN, an Embedding (sparse gradients), B divisible and not divisible
by the number of ranks, a last batch larger and smaller than the number of ranks (ranks
with an empty micro-batch), multi-input models (tuple and dict), sample weights and a
regularisation loss.
"""

from __future__ import annotations

import hashlib

import _job
import _serial_refs
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

COMPILE_ARGS = dict(loss="sparse_categorical_crossentropy", metrics=["accuracy"])

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.005),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
}


def dense_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((10,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3, activation="softmax"),
    ])


def cnn_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(3, activation="softmax"),
    ])


def two_input_model(seed: int, as_dict: bool) -> keras.Model:
    keras.utils.set_random_seed(seed)
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    h = keras.layers.Concatenate()([
        keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01))(a),
        keras.layers.Dense(8, activation="relu")(b),
    ])
    out = keras.layers.Dense(3, activation="softmax")(h)
    return keras.Model({"a": a, "b": b} if as_dict else [a, b], out)


def embedding_model(seed: int) -> keras.Model:
    """An Embedding read by a lookup (its gradient is a tf.IndexedSlices with repeated rows):
    with Adam, serial Keras' update of the slices differs from that of their dense sum."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(8, 4),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3, activation="softmax"),
    ])


def data(kind: str, n: int, seed: int):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n).astype("int32")
    if kind == "embedding":  # 8 tokens, 6 per row: every token repeats within a batch
        x = (rng.integers(0, 6, size=(n, 6)) + y[:, None]).astype("int32") % 8
    elif kind == "dense":
        x = rng.normal(size=(n, 10)).astype("float32") + y[:, None] * 0.3
    elif kind == "cnn":
        x = rng.normal(size=(n, 12, 12, 1)).astype("float32") + y[:, None, None, None] * 0.3
    else:
        a = rng.normal(size=(n, 6)).astype("float32") + y[:, None] * 0.3
        b = rng.normal(size=(n, 4)).astype("float32")
        x = {"a": a, "b": b} if kind == "dict" else (a, b)
    w = rng.uniform(0.5, 1.5, size=n).astype("float32")
    return x, y, w


# name: (model kind, optimizer, global batch B, samples n, epochs, sample weights, shuffle seed,
#        tolerance on losses/metrics, tolerance on weights)
CASES = {
    "dense_sgd_B12_last5": ("dense", "sgd", 12, 12 * 4 + 5, 4, False, None, 1e-5, 2e-5),
    "dense_momentum_B11_last1": ("dense", "sgd_momentum", 11, 11 * 4 + 1, 4, False, None, 1e-5, 2e-5),
    "dense_nesterov_B10_last2": ("dense", "sgd_nesterov", 10, 10 * 5 + 2, 4, False, 7, 1e-5, 2e-5),
    "dense_adam_B12_last1": ("dense", "adam", 12, 12 * 5 + 1, 4, False, None, 1e-5, 2e-5),
    "dense_rmsprop_B11_last5": ("dense", "rmsprop", 11, 11 * 4 + 5, 4, False, 3, 1e-5, 2e-5),
    "dense_adagrad_B13_last2": ("dense", "adagrad", 13, 13 * 4 + 2, 4, False, None, 1e-5, 2e-5),
    "dense_adadelta_B12_exact": ("dense", "adadelta", 12, 60, 4, False, None, 1e-5, 2e-5),
    "dense_adamax_B11_last1": ("dense", "adamax", 11, 11 * 4 + 1, 4, False, None, 1e-5, 2e-5),
    "cnn_momentum_B10_last3": ("cnn", "sgd_momentum", 10, 10 * 4 + 3, 3, False, None, 1e-4, 1e-3),
    "cnn_adam_B11_last1": ("cnn", "adam", 11, 11 * 4 + 1, 3, False, None, 1e-4, 1e-3),
    "tuple_inputs_weights_l2_adam": ("tuple", "adam", 10, 10 * 4 + 1, 3, True, None, 1e-5, 2e-5),
    "dict_inputs_weights_l2_rmsprop": ("dict", "rmsprop", 12, 12 * 3 + 5, 3, True, 5, 1e-5, 2e-5),
    # jit_compile=True (serial and tnt): XLA compiles the step halves around the exchange.
    "dense_adam_B11_last2_xla": ("dense", "adam", 11, 11 * 4 + 2, 3, False, None, 1e-5, 2e-5),
    # Sparse gradients (Embedding): the slices of all ranks, in rank order, as serial Keras'
    # optimizer sees them; last batch of 1 (a rank without data on 2 and 3 ranks).
    "embedding_adam_B8_exact": ("embedding", "adam", 8, 32, 3, False, None, 1e-5, 2e-5),
    "embedding_adam_B10_last1": ("embedding", "adam", 10, 10 * 3 + 1, 3, True, 4, 1e-5, 2e-5),
    "embedding_adam_B10_last1_xla": ("embedding", "adam", 10, 10 * 3 + 1, 3, False, None, 1e-5, 2e-5),
}


def build(kind: str, seed: int) -> keras.Model:
    if kind == "dense":
        return dense_model(seed)
    if kind == "cnn":
        return cnn_model(seed)
    if kind == "embedding":
        return embedding_model(seed)
    return two_input_model(seed, as_dict=(kind == "dict"))


def batched(x, y, w, batch: int, shuffle_seed):
    element = (x, y, w) if w is not None else (x, y)
    ds = tf.data.Dataset.from_tensor_slices(element)
    if shuffle_seed is not None:
        ds = ds.shuffle(64, seed=shuffle_seed)
    return ds.batch(batch)


def run_serial(kind, opt, train, vx, vy, epochs, initial, jit) -> dict:
    """Plain Keras on one process: the reference (one rank computes it, see ``serial_reference``)."""
    serial = build(kind, seed=3)
    serial.set_weights(initial)
    serial.compile(optimizer=OPTIMIZERS[opt](), jit_compile=jit, **COMPILE_ARGS)
    history = serial.fit(train, epochs=epochs, validation_data=batched(vx, vy, None, 7, None), verbose=0).history
    return {
        "history": history,
        "weights": serial.get_weights(),
        "evaluate": serial.evaluate(batched(vx, vy, None, 7, None), verbose=0),
        "predict": serial.predict(batched(vx, vy, None, 7, None).map(lambda a, b: (a,)), verbose=0),
    }


def _datasets(kind, batch, n, weighted, shuffle_seed):
    """(serial's training dataset, tnt's, validation x, y), made as the case always made them:
    under one global seed, serial's first (a seeded shuffle's order depends on the global seed
    in force when the dataset is created)."""
    x, y, w = data(kind, n, seed=11)
    vx, vy, _ = data(kind, 29, seed=12)
    w = w if weighted else None
    keras.utils.set_random_seed(0)
    train_serial = batched(x, y, w, batch, shuffle_seed)
    train_tnt = batched(x, y, w, batch, shuffle_seed)
    return train_serial, train_tnt, vx, vy


def _case_serial(kind, opt, batch, n, epochs, weighted, shuffle_seed, jit) -> dict:
    """A case's serial reference (on whichever rank calls it)."""
    train_serial, _, vx, vy = _datasets(kind, batch, n, weighted, shuffle_seed)
    initial = build(kind, seed=3).get_weights()
    return run_serial(kind, opt, train_serial, vx, vy, epochs, initial, jit)


def serial_reference(name: str) -> dict:
    return _case_serial(*CASES[name][:7], _jit(name))


def _jit(name: str):
    return name.endswith("_xla") or "auto"


def run_case(kind, opt, batch, n, epochs, weighted, shuffle_seed, jit) -> dict:
    """One case with its serial reference trained on the master first (for jobs with cases
    of their own: tests/multihost/jobs/exactness.py); ``main`` shares its references out."""
    ref = _case_serial(kind, opt, batch, n, epochs, weighted, shuffle_seed, jit) if tnt.is_master_rank() else None
    return _case_tnt(kind, opt, batch, n, epochs, weighted, shuffle_seed, jit, ref)


def _case_tnt(kind, opt, batch, n, epochs, weighted, shuffle_seed, jit, ref: dict | None) -> dict:
    """The case under tnt.Model on every rank; the differences to ``ref`` (the master's)."""
    _, train_tnt, vx, vy = _datasets(kind, batch, n, weighted, shuffle_seed)
    initial = build(kind, seed=3).get_weights()

    model = tnt.Model(build(kind, seed=100 + tnt.get_rank()))  # rank-dependent init: rank 0's must win
    model.set_weights(initial)
    model.compile(optimizer=OPTIMIZERS[opt](), jit_compile=jit, **COMPILE_ARGS)
    history = model.fit(train_tnt, epochs=epochs, validation_data=batched(vx, vy, None, 7, None), verbose=0).history
    evaluated = model.evaluate(batched(vx, vy, None, 7, None), verbose=0)
    predicted = model.predict(batched(vx, vy, None, 7, None).map(lambda a, b: (a,)), verbose=0)
    weights = model.get_weights()
    digests = tnt_comm.allgather_object(
        hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in weights)).hexdigest())
    if ref is None:  # the master compares
        return {}
    return {
        "history_diff": _job.history_diff(ref["history"], history),
        "weight_diff": _job.max_abs_diff(ref["weights"], weights),
        "evaluate_diff": _job.max_abs_diff(ref["evaluate"], evaluated),
        "predict_diff": _job.max_abs_diff(ref["predict"], predicted),
        "predict_rows": [int(np.shape(ref["predict"])[0]), int(np.shape(predicted)[0])],
        "steps": int(len(history["loss"]) * -(-n // batch)),
        "ranks_identical": len(set(digests)) == 1,
        "history_keys": sorted(history),
    }


def main() -> None:
    out = _job.out_path()
    results = {}
    names = _job.only(CASES)
    refs = _serial_refs.shared(names, serial_reference)  # the serial runs, shared out over the ranks
    for name in names:
        results[name] = _case_tnt(*CASES[name][:7], _jit(name), refs.get(name))
        results[name].update(tol_loss=CASES[name][7], tol_weights=CASES[name][8])
    _job.write(out, {"ranks": tnt.get_size(), "cases": results})


if __name__ == "__main__":
    main()
