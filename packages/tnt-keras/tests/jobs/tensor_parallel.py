"""Tensor-parallel job: ParallelStrategy.TENSOR with t = N against serial Keras, in one launch.

For each case the serial model (plain ``keras.Model.fit``) and the tensor-parallel model
start from the same weights and see the same global batches; rank 0 writes the largest
differences of History, gathered weights, evaluate and predict, next to the plan, every
rank's local variable shapes, and whether replicated weights are bitwise equal on all
ranks. Plan and error checks need no training and run in the same job.
"""

from __future__ import annotations

import _job
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

TP = tnt.tensor_parallel
CHECKS: dict[str, dict] = {}


def check(name: str, ok: bool, detail: object = "") -> None:
    CHECKS[name] = {"ok": bool(ok), "detail": str(detail)[:2000]}


def mlp(seed: int) -> keras.Model:
    """column -> row, column -> (Activation) -> row, lone Dense column+allgather (softmax)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((10,))
    h = keras.layers.Dense(16, activation="relu", name="up1")(x)
    h = keras.layers.Dense(12, name="down1")(h)
    h = keras.layers.Dense(24, name="up2")(h)
    h = keras.layers.Activation("tanh", name="act")(h)
    h = keras.layers.Dense(8, activation="relu", name="down2")(h)
    y = keras.layers.Dense(4, activation="softmax", name="head")(h)
    return keras.Model(x, y, name="mlp")


def embed(seed: int) -> keras.Model:
    """Embedding by vocabulary rows, then a Dense pair (the row layer ends in softmax)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((7,), dtype="int32"),
        keras.layers.Embedding(30, 8, name="emb"),
        keras.layers.GlobalAveragePooling1D(name="pool"),
        keras.layers.Dense(16, activation="relu", name="up"),
        keras.layers.Dense(4, activation="softmax", name="down"),
    ], name="embed")


def dropout(seed: int) -> keras.Model:
    """Dropout inside a column -> row chain (serial mask slice) and a replicated one."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((10,))
    h = keras.layers.Dense(16, activation="relu", name="up")(x)
    h = keras.layers.Dropout(0.3, name="drop_split")(h)
    h = keras.layers.Dense(6, name="down")(h)
    h = keras.layers.Dropout(0.2, name="drop_replicated")(h)
    y = keras.layers.Dense(4, activation="softmax", name="head")(h)
    return keras.Model(x, y, name="dropout")


def block(seed: int) -> keras.Model:
    """A Transformer encoder block: Embedding (vocab), attention by heads with dropout,
    residuals and LayerNorm (replicated), an FFN pair with Dropout inside, a softmax head."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), dtype="int32")
    e = keras.layers.Embedding(30, 16, name="emb")(x)
    a = keras.layers.MultiHeadAttention(4, 4, dropout=0.1, name="mha")(e, e)
    h = keras.layers.LayerNormalization(name="ln1")(keras.layers.Add(name="res1")([e, a]))
    f = keras.layers.Dense(32, activation="relu", name="ffn_up")(h)
    f = keras.layers.Dropout(0.1, name="ffn_drop")(f)
    f = keras.layers.Dense(16, name="ffn_down")(f)
    h = keras.layers.LayerNormalization(name="ln2")(keras.layers.Add(name="res2")([h, f]))
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(x, keras.layers.Dense(4, activation="softmax", name="head")(pooled), name="block")


def data(kind: str, n: int):
    rng = np.random.default_rng(11)
    y = rng.integers(0, 4, size=n)
    if kind in ("embed", "block"):
        return rng.integers(0, 30, size=(n, 7 if kind == "embed" else 6)).astype("int32"), y
    return rng.normal(size=(n, 10)).astype("float32"), y


def optimizer(name: str):
    if name == "sgd_momentum":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    return keras.optimizers.Adam(0.01)


BUILD = {"mlp": mlp, "embed": embed, "dropout": dropout, "block": block}
EXPECTED_PLANS = {
    "mlp": {"up1": "column", "down1": "row", "up2": "column", "down2": "row", "head": "column+allgather"},
    "embed": {"emb": "vocab", "up": "column", "down": "row"},
    "dropout": {"up": "column", "down": "row", "head": "column+allgather"},
    "block": {"emb": "vocab", "mha": "heads", "ffn_up": "column", "ffn_down": "row", "head": "column+allgather"},
}
EXPECTED_SPLIT_DROPOUTS = {"mlp": [], "embed": [], "dropout": ["drop_split"], "block": ["ffn_drop"]}
# name: (model, optimizer, global batch, samples, epochs, tol losses, tol weights). The
# embedding and dropout models' pieces are all in the block, so only their plans are checked.
CASES = {
    "mlp_sgd_momentum": ("mlp", "sgd_momentum", 12, 12 * 4 + 5, 2, 1e-5, 2e-5),
    "mlp_adam": ("mlp", "adam", 11, 11 * 4 + 1, 2, 1e-5, 2e-5),
    "block_adam": ("block", "adam", 12, 12 * 3 + 4, 2, 1e-5, 2e-5),
}


def run_case(kind, opt, batch, n, epochs, t, strategy=tnt.ParallelStrategy.TENSOR, make_plan=None):
    """``make_plan(source model)``: the tensor_parallel_plan (default: automatic, every pair split)."""
    x, y = data(kind, n)
    xv, yv = data(kind, 2 * batch + 1)
    serial, source = BUILD[kind](3), BUILD[kind](3)
    plan = make_plan(source) if make_plan else TP.plan(source, tensor_parallel_size=t, min_split_params=0)
    model = tnt.Model(source, parallel_strategy=strategy, tensor_parallel_size=t, tensor_parallel_plan=plan)
    start_same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), serial.get_weights()))
    for m in (serial, model):
        m.compile(optimizer(opt), "sparse_categorical_crossentropy", metrics=["accuracy"])
    fit = dict(batch_size=batch, epochs=epochs, shuffle=False, verbose=0, validation_data=(xv, yv))
    h_serial = serial.fit(x, y, **fit).history
    h_tensor = model.fit(x, y, **fit).history
    w_tensor = model.get_weights()
    result = {
        "plan": model.plan.split_layers(),
        "start_same": start_same,
        "history_diff": _job.history_diff(h_serial, h_tensor),
        "weight_diff": _job.max_abs_diff(serial.get_weights(), w_tensor),
        "evaluate_diff": _job.max_abs_diff(serial.evaluate(xv, yv, verbose=0), model.evaluate(xv, yv, verbose=0)),
        "predict_diff": _job.max_abs_diff(serial.predict(xv, verbose=0), model.predict(xv, verbose=0)),
        "serial_shapes": [list(w.shape) for w in serial.get_weights()],
        "gathered_shapes": [list(w.shape) for w in w_tensor],
        "local_shapes": tnt_comm.allgather_object(
            {v.path: list(v.shape) for v in model.trainable_variables}),
        "optimizer_slot_shapes": tnt_comm.allgather_object(
            sorted({tuple(v.shape) for v in model.optimizer.variables if len(v.shape)})),
        "replicated_checksums": tnt_comm.allgather_object(model.replicated_checksum()),
        "shard_checksums": tnt_comm.allgather_object(model.shard_checksum()),
        "histories_per_rank_equal": len({repr(h) for h in tnt_comm.allgather_object(h_tensor)}) == 1,
        "weights_per_rank_equal": len({_digest(w_tensor) for _ in [0]} |
                                      set(tnt_comm.allgather_object(_digest(w_tensor)))) == 1,
    }
    return result


def _digest(arrays) -> str:
    import hashlib

    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def expect_error(name: str, fn, *words: str) -> None:
    try:
        fn()
    except TP.TensorParallelError as err:
        check(name, all(w in str(err) for w in words), err)
    else:
        check(name, False, "no error raised")


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.d = keras.layers.Dense(4)

    def call(self, x):
        return self.d(x)


def plan_and_error_checks(t: int) -> None:
    for kind, expected in EXPECTED_PLANS.items():
        p = TP.plan(BUILD[kind](0), tensor_parallel_size=t, min_split_params=0)
        got = (p.split_layers(), p.split_dropouts)
        check(f"plan_{kind}", got == (expected, EXPECTED_SPLIT_DROPOUTS[kind]), got)
    heads3 = TP.plan(block(0), tensor_parallel_size=3, min_split_params=0)
    check("plan_heads_not_divisible_replicated", heads3.kind("mha") == "replicated" and
          "num_heads 4 does not divide by t=3" in heads3.summary(print_fn=lambda s: None), heads3.split_layers())
    odd = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="five"),
                            keras.layers.Dense(3, name="three")], name="odd")
    p = TP.plan(odd, tensor_parallel_size=2, min_split_params=0)
    text = p.summary(print_fn=lambda s: None)
    check("plan_non_divisible_replicated_with_note",
          p.split_layers() == {} and "does not divide by t=2" in text, text)
    big = TP.plan(mlp(0), tensor_parallel_size=t)  # default min_split_params: all tiny -> pairs only
    check("plan_default_keeps_small_lone_dense_replicated", big.kind("head") == "replicated", big.split_layers())
    seq = TP.plan(mlp(0), tensor_parallel_size=1)
    check("plan_t1_replicates_all", seq.split_layers() == {}, seq.split_layers())
    expect_error("error_subclassed", lambda: tnt.Model(Subclassed(), parallel_strategy=tnt.ParallelStrategy.TENSOR,
                                                       tensor_parallel_size=t), "subclassed", "functional API")
    expect_error("error_t_below_1", lambda: tnt.Model(mlp(0), parallel_strategy=tnt.ParallelStrategy.TENSOR,
                                                      tensor_parallel_size=0), "integer >= 1")
    expect_error("error_t_not_job_size", lambda: tnt.Model(mlp(0), parallel_strategy=tnt.ParallelStrategy.TENSOR,
                                                           tensor_parallel_size=t + 1),
                 f"tarantella -n {t + 1}", f"{t} rank")
    expect_error("error_size_with_data_strategy",
                 lambda: tnt.Model(mlp(0), tensor_parallel_size=t), "ParallelStrategy.TENSOR")
    expect_error("error_missing_size",
                 lambda: tnt.Model(mlp(0), parallel_strategy=tnt.ParallelStrategy.TENSOR), "tensor_parallel_size=")
    tp = tnt.Model(mlp(0), parallel_strategy=tnt.ParallelStrategy.TENSOR, tensor_parallel_size=t,
                   tensor_parallel_plan=TP.plan(mlp(0), tensor_parallel_size=t, min_split_params=0))
    expect_error("error_clipnorm", lambda: tp.compile(keras.optimizers.SGD(0.1, clipnorm=1.0), "mse"),
                 "clipnorm", "clipvalue")
    expect_error("error_save_not_built", lambda: tp.save("/nonexistent/x.keras"), "get_weights")


def unseeded_shuffle_check(t: int) -> None:
    """Keras' default shuffle=True with no global seed and no op determinism (a user
    script): every rank of the group must still read the same batches."""
    from tensorflow.python.framework import config as tf_config  # no public switch back

    x, y = data("mlp", 40)
    source = mlp(5)  # seeds the global generators: unset them after
    tf.random.set_seed(None)
    tf_config.disable_op_determinism()
    try:
        # The default plan keeps this small model replicated, so ranks that read different
        # batches end with different weights, which fit's group check reports.
        model = tnt.Model(source, parallel_strategy=tnt.ParallelStrategy.TENSOR, tensor_parallel_size=t)
        model.compile(optimizer("sgd_momentum"), "sparse_categorical_crossentropy")
        try:
            history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
            same = len({repr(h) for h in tnt_comm.allgather_object(history)}) == 1
            check("unseeded_shuffle_same_batches_on_all_ranks", same, history)
        except Exception as err:  # the group check after fit raises when batches differed
            check("unseeded_shuffle_same_batches_on_all_ranks", False, f"{type(err).__name__}: {err}")
    finally:
        tf_config.enable_op_determinism()


def main() -> None:
    out = _job.out_path()
    t = tnt.get_size()
    plan_and_error_checks(t)
    unseeded_shuffle_check(t)
    cases = {}
    for name, (kind, opt, batch, n, epochs, tol_l, tol_w) in CASES.items():
        cases[name] = run_case(kind, opt, batch, n, epochs, t)
        cases[name].update(tol_loss=tol_l, tol_weights=tol_w)
    _job.write(out, {"ranks": t, "checks": CHECKS, "cases": cases})


if __name__ == "__main__":
    main()
