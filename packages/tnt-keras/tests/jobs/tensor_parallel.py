"""Tensor-parallel job: ParallelStrategy.TENSOR with t = N against serial Keras, in one launch.

For each case the serial model (plain ``keras.Model.fit``) and the tensor-parallel model
start from the same weights and see the same global batches; rank 0 writes the largest
differences of History, gathered weights, evaluate and predict, next to the plan, every
rank's local variable shapes, and whether replicated weights are bitwise equal on all
ranks. Plan and error checks need no training and run in the same job.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

# The 3-rank launch (a launch of its own), before TensorFlow runs its first function: XLA's
# clustering pass writes the graphs it clustered here, so the jit case can show that XLA
# compiled segments of the step. The 2-rank job runs inside the shared 2-rank launch, where
# TensorFlow has long read its flags: it sets nothing.
XLA_DUMPS = Path(tempfile.mkdtemp(prefix="tnt_xla_dumps_"))
if "--t2-file" in sys.argv:
    os.environ["TF_XLA_FLAGS"] = "--tf_xla_clustering_debug"
    os.environ["TF_DUMP_GRAPH_PREFIX"] = str(XLA_DUMPS)

import _job  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tarantella as tnt  # noqa: E402
import tnt_comm  # noqa: E402

TP = tnt.tensor_parallel
CHECKS: dict[str, dict] = {}
TRAINED: dict[tuple[str, str], tuple[keras.Model, keras.Model]] = {}  # (serial, tensor) after run_case


def check(name: str, ok: bool, detail: object = "") -> None:
    CHECKS[name] = {"ok": bool(ok), "detail": str(detail)[:2000]}


def mlp(seed: int, widths=(16, 12, 24, 8, 4), name: str = "mlp") -> keras.Model:
    """column -> row, column -> (Activation) -> row, lone Dense column+allgather (softmax)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((10,))
    h = keras.layers.Dense(widths[0], activation="relu", name="up1")(x)
    h = keras.layers.Dense(widths[1], name="down1")(h)
    h = keras.layers.Dense(widths[2], name="up2")(h)
    h = keras.layers.Activation("tanh", name="act")(h)
    h = keras.layers.Dense(widths[3], activation="relu", name="down2")(h)
    y = keras.layers.Dense(widths[4], activation="softmax", name="head")(h)
    return keras.Model(x, y, name=name)


def mlp3(seed: int) -> keras.Model:
    """The MLP with widths divisible by 3 (t = 3): two column/row pairs, a column+allgather head."""
    return mlp(seed, (18, 12, 24, 9, 6), "mlp3")


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
    residuals and LayerNorm (replicated), an FFN pair with Dropout inside, a softmax head.
    The FFN's first layer and the head are EinsumDense projections ("abc,cd->abd",
    "ab,bc->ac"): split as the Dense layers they are (column; column+allgather)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), dtype="int32")
    e = keras.layers.Embedding(30, 16, name="emb")(x)
    a = keras.layers.MultiHeadAttention(4, 4, dropout=0.1, name="mha")(e, e)
    h = keras.layers.LayerNormalization(name="ln1")(keras.layers.Add(name="res1")([e, a]))
    f = keras.layers.EinsumDense("abc,cd->abd", (None, 32), bias_axes="d", activation="relu", name="ffn_up")(h)
    f = keras.layers.Dropout(0.1, name="ffn_drop")(f)
    f = keras.layers.Dense(16, name="ffn_down")(f)
    h = keras.layers.LayerNormalization(name="ln2")(keras.layers.Add(name="res2")([h, f]))
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    head = keras.layers.EinsumDense("ab,bc->ac", 4, bias_axes="c", activation="softmax", name="head")
    return keras.Model(x, head(pooled), name="block")


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


BUILD = {"mlp": mlp, "mlp3": mlp3, "embed": embed, "dropout": dropout, "block": block}
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
#: The 3-rank launch (t = 3): every layer of mlp3 split, a last batch of 1 sample.
CASES_T3 = {"mlp3_adam": ("mlp3", "adam", 12, 12 * 3 + 1, 2, 1e-5, 2e-5)}


def clustered_graphs() -> int:
    """Graphs XLA's auto-clustering marked for compilation so far (on this rank)."""
    return sum("_XlaCluster" in f.read_text(errors="replace")
               for f in XLA_DUMPS.glob("mark_for_compilation_annotated*"))


def run_case(kind, opt, batch, n, epochs, t, strategy=tnt.ParallelStrategy.TENSOR, make_plan=None,
             callbacks=None, jit=False, **options):
    """``make_plan(source model)``: the tensor_parallel_plan (default: automatic, every pair split);
    ``options``: more tnt.Model arguments (e.g. the pipeline's with ALL)."""
    x, y = data(kind, n)
    xv, yv = data(kind, 2 * batch + 1)
    serial, source = BUILD[kind](3), BUILD[kind](3)
    plan = make_plan(source) if make_plan else TP.plan(source, tensor_parallel_size=t, min_split_params=0)
    model = tnt.Model(source, parallel_strategy=strategy, tensor_parallel_size=t, tensor_parallel_plan=plan,
                      **options)
    local = getattr(model, "stage_model", model)  # with pipeline stages: this rank's stage
    start_same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), serial.get_weights()))
    for m in (serial, model):
        m.compile(optimizer(opt), "sparse_categorical_crossentropy", metrics=["accuracy"],
                  **({"jit_compile": True} if jit and m is model else {}))
    fit = dict(batch_size=batch, epochs=epochs, shuffle=False, verbose=0, validation_data=(xv, yv))
    h_serial = serial.fit(x, y, **fit).history
    h_tensor = model.fit(x, y, **fit, callbacks=callbacks).history
    w_tensor = model.get_weights()
    TRAINED[kind, opt] = (serial, model, h_tensor, w_tensor)
    result = {
        "plan": getattr(model, "tensor_plan", model.plan).split_layers(),
        "start_same": start_same,
        "history_diff": _job.history_diff(h_serial, h_tensor),
        "weight_diff": _job.max_abs_diff(serial.get_weights(), w_tensor),
        "evaluate_diff": _job.max_abs_diff(serial.evaluate(xv, yv, verbose=0), model.evaluate(xv, yv, verbose=0)),
        "predict_diff": _job.max_abs_diff(serial.predict(xv, verbose=0), model.predict(xv, verbose=0)),
        "serial_shapes": [list(w.shape) for w in serial.get_weights()],
        "gathered_shapes": [list(w.shape) for w in w_tensor],
        "local_shapes": tnt_comm.allgather_object(
            {v.path: list(v.shape) for v in local.trainable_variables}),
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


def deferred_build_check(t: int) -> None:
    """A model built in tnt.pipelining.deferred_variables(): its split layers never get a
    whole value on any rank, it starts from the values an eager build gets, and trains
    as serial Keras does."""
    x, y = data("block", 21)
    serial = block(3)
    with tnt.pipelining.deferred_variables():
        source = block(3)
    model = tnt.Model(source, parallel_strategy=tnt.ParallelStrategy.TENSOR, tensor_parallel_size=t,
                      tensor_parallel_plan=TP.plan(source, tensor_parallel_size=t, min_split_params=0))
    split = set(model.plan.split_layers())
    whole = [w.path for layer in source.layers if layer.name in split for w in layer.weights
             if not tnt.pipelining.is_deferred(w)]
    check("deferred_build_split_layers_never_whole", split and not whole, f"split {sorted(split)}, whole {whole}")
    start = _job.max_abs_diff(serial.get_weights(), model.get_weights())
    for m in (serial, model):
        m.compile(optimizer("adam"), "sparse_categorical_crossentropy")
    fit = dict(batch_size=8, epochs=1, shuffle=False, verbose=0)
    h = _job.history_diff(serial.fit(x, y, **fit).history, model.fit(x, y, **fit).history)
    w = _job.max_abs_diff(serial.get_weights(), model.get_weights())
    check("deferred_build_starts_and_trains_as_eager", start == 0 and h <= 1e-5 and w <= 2e-5,
          f"start {start:.2e}, history {h:.2e}, weights {w:.2e}")


def loss_scaled_mlp() -> keras.Model:
    """A float16 column/row pair whose column-shard 0 has 30x larger activations, so the
    row layer's kernel rows of shard 0 get 30x larger gradients: as the loss scale falls,
    for several steps only shard 0's gradients overflow float16."""
    keras.utils.set_random_seed(4)
    x = keras.Input((6,))
    h = keras.layers.Dense(8, name="up", dtype="mixed_float16")(x)  # per layer: no global policy
    h = keras.layers.Dense(4, name="down", dtype="mixed_float16")(h)
    model = keras.Model(x, keras.layers.Activation("linear", dtype="float32", name="out")(h), name="lso")
    kernel, bias = model.get_layer("up").get_weights()
    kernel[:, :4] *= 30.0
    model.get_layer("up").set_weights([kernel, bias])
    return model


def loss_scale_check(t: int) -> None:
    """A LossScaleOptimizer skips a step exactly when serial Keras does, on every rank:
    its finiteness decision covers every shard's gradients (_loss_scale). Without it the
    rank whose shard stays finite applied steps the other skipped (scale 2048 vs 128)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, 4)).astype("float32")
    serial, source = loss_scaled_mlp(), loss_scaled_mlp()
    model = tnt.Model(source, parallel_strategy=tnt.ParallelStrategy.TENSOR, tensor_parallel_size=t,
                      tensor_parallel_plan=TP.plan(source, tensor_parallel_size=t, min_split_params=0))
    for m in (serial, model):
        m.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3), initial_scale=2.0**16), "mse")
    fit = dict(batch_size=8, epochs=4, shuffle=False, verbose=0)
    h_serial, h_tensor = serial.fit(x, y, **fit).history, model.fit(x, y, **fit).history

    def state(m):
        return float(m.optimizer.dynamic_scale.numpy()), int(m.optimizer.iterations.numpy())

    ranks = tnt_comm.allgather_object((state(model), [v.numpy() for v in model.local_model.get_layer("down").weights]))
    want = state(serial)
    biases = [np.array_equal(bias, ranks[0][1][1]) for _, (_, bias) in ranks]  # down's bias: whole on every rank
    loss = max(abs(a - b) / abs(b) for a, b in zip(h_tensor["loss"], h_serial["loss"]))
    # float16 compute: the row split rounds its partial sums to float16 (serial: once), so
    # compare relative to each weight's largest magnitude, at float16's precision.
    weights = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                  for a, b in zip(model.get_weights(), serial.get_weights()))
    plan_ok = model.plan.split_layers() == {"up": "column", "down": "row"}
    check("loss_scale_decided_as_serial_on_every_rank",
          plan_ok and 0 < want[1] < 16 and  # some of the 16 steps skipped, some applied
          all(s == want for s, _ in ranks) and all(biases) and loss <= 2e-3 and weights <= 2e-3,
          f"plan ok {plan_ok}; serial (scale, applied steps) {want}, ranks {[s for s, _ in ranks]}, "
          f"row bias equal {biases}, loss rel diff {loss:.2e}, weights rel diff {weights:.2e}")


# -- save / load ------------------------------------------------------------------------------
def on_master(fn):
    """``fn()`` on the master only (serial Keras), its result on every rank."""
    return tnt_comm.broadcast_object(fn() if tnt.is_master_rank() else None, 0)


class _ReadLog:
    """Records, for every dataset the loader reads, (saved elements, elements read)."""

    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []
        self.real = tnt._core.internals.h5_dataset

    def __enter__(self):
        def logged(store, group, key):
            dataset = self.real(store, group, key)
            return None if dataset is None else _LoggedDataset(dataset, self.reads)

        tnt._core.internals.h5_dataset = logged
        return self

    def __exit__(self, *exc) -> None:
        tnt._core.internals.h5_dataset = self.real


class _LoggedDataset:
    def __init__(self, dataset, reads) -> None:
        self.dataset, self.reads, self.shape = dataset, reads, dataset.shape

    def __getitem__(self, index):
        value = self.dataset[index]
        self.reads.append((int(np.prod(self.shape)), int(np.asarray(value).size)))
        return value


def save_load_checks(t: int, work: Path) -> dict:
    """Tensor save -> plain Keras load; serial save -> tensor load -> continued training
    == serial continuation; the file of this t (and serial predictions) for the t = 1 test."""
    serial, model, _, _ = TRAINED["block", "adam"]
    xp, _ = data("block", 9)
    xc, yc = data("block", 12 * 2 + 5)
    tp_path, serial_path = work / "tp.keras", work / "serial.keras"
    names = _job.auto_name_counters()
    with master_receipts(model) as received:
        model.save(tp_path)
    _job.auto_name_counters(names)  # the gathered model's inner layers get the same automatic names
    streamed = streamed_file_check(model, tp_path, work)
    expect_error("error_load_weights_file_as_model",  # written by ModelCheckpoint in run_case
                 lambda: tnt.models.load_model(work / "ckpt_2.weights.h5", tensor_parallel_size=t,
                                               parallel_strategy=tnt.ParallelStrategy.TENSOR),
                 "not a .keras file", "load_weights")

    def plain_keras():
        plain = keras.saving.load_model(tp_path)  # plain Keras opens the joined file
        serial.save(serial_path)
        np.save(work / "tp_x.npy", xp)
        np.save(work / "tp_predict_serial.npy", serial.predict(xp, verbose=0))
        return {
            "plain_predict_diff": _job.max_abs_diff(plain.predict(xp, verbose=0), serial.predict(xp, verbose=0)),
            "plain_weight_diff": _job.max_abs_diff(plain.get_weights(), serial.get_weights()),
            "plain_optimizer_diff": _job.max_abs_diff([v.numpy() for v in plain.optimizer.variables],
                                                      [v.numpy() for v in serial.optimizer.variables]),
            "plain_iterations": int(plain.optimizer.iterations.numpy()),
            "serial_iterations": int(serial.optimizer.iterations.numpy()),
        }

    out = on_master(plain_keras)
    out.update(streamed, save_largest_message_bytes=received["message"],
               largest_variable_bytes=max(w.nbytes for w in serial.get_weights()))
    fit = dict(batch_size=6, epochs=2, shuffle=False, verbose=0)
    keras.utils.set_random_seed(31)  # the dropout layers' seeds, drawn when the file's model is built
    with _ReadLog() as log:
        cont = tnt.models.load_model(serial_path, parallel_strategy=tnt.ParallelStrategy.TENSOR,
                                     tensor_parallel_size=t)
    split_axis_vars = sum(1 for _, _, axis in cont._split_variables() if axis is not None)
    sliced = [(whole, read) for whole, read in log.reads if read != whole]
    out["load_reads"] = tnt_comm.allgather_object(
        {"sliced": len(sliced), "expected_sliced": 3 * split_axis_vars,  # each weight + Adam's 2 slots
         "all_slices_1_of_t": all(whole == read * t for whole, read in sliced)})
    out["load_leaves_serial_split_layers_unmaterialised"] = all(tnt_comm.allgather_object(
        all(tnt.pipelining.is_deferred(s) for s, _, _ in cont._split_variables())))
    h_cont = cont.fit(xc, yc, **fit).history
    w_cont = cont.get_weights()

    def serial_continuation():
        keras.utils.set_random_seed(31)
        ref = keras.saving.load_model(serial_path)
        return ref.fit(xc, yc, **fit).history, ref.get_weights()

    h_ref, w_ref = on_master(serial_continuation)
    out["continue_history_diff"] = _job.history_diff(h_ref, h_cont)
    out["continue_weight_diff"] = _job.max_abs_diff(w_ref, w_cont)
    out["continue_local_shapes"] = tnt_comm.allgather_object(
        {v.path: list(v.shape) for v in cont.trainable_variables if v.path.startswith("mha/query")})
    return out


@contextlib.contextmanager
def master_receipts(model):
    """On the master, inside the block: the largest array its tensor group's communicator
    handed it (``message``: a slice sent to it, or an allgather's joined variable) and the
    peak of the bytes Python and numpy allocated (``traced_peak``, tracemalloc: arrays
    joined or copied; not TensorFlow's buffers nor tnt_comm's receive buffers)."""
    comm = model.group.comm
    seen = {"message": 0, "traced_peak": 0}
    master = tnt.is_master_rank()

    def counting(real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            seen["message"] = max(seen["message"], int(out.nbytes))
            return out
        return call

    for name in ("recv", "allgather"):
        setattr(comm, name, counting(getattr(comm, name)))
    if master:
        tracemalloc.start()
    try:
        yield seen
    finally:
        if master:
            seen["traced_peak"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        del comm.recv, comm.allgather


def streamed_file_check(model, path: Path, work: Path) -> dict:
    """The streamed ``.keras`` file against Keras' own save of the gathered serial model:
    the same members, configuration, attributes and bitwise the same arrays."""
    full = model._tnt_gather_serial()  # every rank takes part; the serial model on the master
    return on_master(lambda: _job.same_file_as_keras(path, full, work / "tp_gathered.keras"))


def streamed_save_memory_check(t: int, work: Path) -> dict:
    """A wider MLP (three 1024 x 1024 kernels, Adam's slots built: 36 MiB of state beside
    its small layers) saved at t: what the master allocates during ``save`` (tracemalloc's
    peak) against its largest serial variable; the gathered path held every joined weight
    and slot at once (about the whole state)."""
    keras.utils.set_random_seed(5)
    source = mlp(5, (1024, 1024, 1024, 1024, 4), "wide")
    model = tnt.Model(source, parallel_strategy=tnt.ParallelStrategy.TENSOR, tensor_parallel_size=t,
                      tensor_parallel_plan=TP.plan(source, tensor_parallel_size=t, min_split_params=0))
    model.compile(optimizer("adam"), "sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)  # its slots, as after a step (no fit to trace)
    with master_receipts(model) as received:
        model.save(work / "wide.keras")
    state = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in source.weights) * 3  # + Adam's 2 slots
    return {"wide_save_traced_peak_bytes": received["traced_peak"], "wide_save_largest_message_bytes": received["message"],
            "wide_largest_variable_bytes": 1024 * 1024 * 4, "wide_state_bytes": state}


class Clock:
    """Wall and this process's CPU seconds of a section (CPU time: a figure that a loaded
    machine inflates less)."""

    def __init__(self, into: dict, name: str) -> None:
        self.into, self.name = into, name

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc) -> None:
        self.into[self.name] = (time.perf_counter() - self.wall, time.process_time() - self.cpu)


class CopyBackup(keras.callbacks.Callback):
    """After epoch 1, the master copies the backup directory: what a job killed right then
    leaves behind (the run itself goes on and deletes its own backup at the end)."""

    def __init__(self, backup: Path, copy: Path) -> None:
        super().__init__()
        self.backup, self.copy = backup, copy

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0 and tnt.is_master_rank():
            shutil.copytree(self.backup, self.copy)


def checkpoint_callbacks(work: Path) -> list:
    """For the mlp_adam case's fit: ModelCheckpoint (whole model, weights only) and a
    BackupAndRestore whose state after epoch 1 is kept."""
    return [keras.callbacks.BackupAndRestore(str(work / "backup")), CopyBackup(work / "backup", work / "killed"),
            keras.callbacks.ModelCheckpoint(str(work / "ckpt_{epoch}.keras")),
            keras.callbacks.ModelCheckpoint(str(work / "ckpt_{epoch}.weights.h5"), save_weights_only=True)]


def checkpoint_checks(t: int, work: Path, strategy=tnt.ParallelStrategy.TENSOR, make_plan=None,
                      batch_n_epochs=None) -> dict:
    """The checkpoints of the mlp_adam case are serial files of its weights; its backup
    after epoch 1 resumes (on a model started elsewhere) and ends as the whole run did.
    ``make_plan``, ``batch_n_epochs``: the case's (default: TENSOR's mlp_adam)."""
    _, _, h_whole, w_whole = TRAINED["mlp", "adam"]

    def read_checkpoints():
        plain = keras.saving.load_model(work / "ckpt_2.keras")
        weights_only = mlp(0)
        weights_only.load_weights(work / "ckpt_2.weights.h5")
        return {"files": sorted(p.name for p in work.glob("ckpt_*")),
                "checkpoint_weight_diff": _job.max_abs_diff(plain.get_weights(), w_whole),
                "checkpoint_weights_only_diff": _job.max_abs_diff(weights_only.get_weights(), w_whole),
                "backup_dir_removed": not (work / "backup").exists()}

    out = on_master(read_checkpoints)
    batch, n, epochs = batch_n_epochs or CASES["mlp_adam"][2:5]
    x, y = data("mlp", n)
    xv, yv = data("mlp", 2 * batch + 1)
    source = mlp(8)  # other initial weights: all must come from the backup
    plan = make_plan(source) if make_plan else TP.plan(source, tensor_parallel_size=t, min_split_params=0)
    resumed = tnt.Model(source, parallel_strategy=strategy, tensor_parallel_size=t, tensor_parallel_plan=plan)
    resumed.compile(optimizer("adam"), "sparse_categorical_crossentropy", metrics=["accuracy"])
    h_resumed = resumed.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                            validation_data=(xv, yv),
                            callbacks=[keras.callbacks.BackupAndRestore(str(work / "killed"))]).history
    out["resumed_epochs"] = len(h_resumed["loss"])
    out["resume_history_diff"] = _job.history_diff(h_resumed, {k: v[-1:] for k, v in h_whole.items()})
    out["resume_weight_diff"] = _job.max_abs_diff(resumed.get_weights(), w_whole)
    return out


def t3_load_checks(work: Path, t2_file: Path | None) -> dict:
    """At q = 3: the serial file of the trained mlp3 case and the 2-rank job's t = 2 file
    (the block model: its vocabulary rows re-sliced 2 -> 3, the rest replicated at t = 3)
    predict as the serial models they were saved from."""
    serial, _, _, _ = TRAINED["mlp3", "adam"]
    xp, _ = data("mlp3", 9)
    path = work / "serial3.keras"
    on_master(lambda: serial.save(path))
    loaded = tnt.models.load_model(path, parallel_strategy=tnt.ParallelStrategy.TENSOR, tensor_parallel_size=3)
    out = {"serial_file_plan": loaded.plan.split_layers(),
           "serial_file_predict_diff": _job.max_abs_diff(serial.predict(xp, verbose=0), loaded.predict(xp, verbose=0)),
           "serial_file_local_shapes": tnt_comm.allgather_object(
               {v.path: list(v.shape) for v in loaded.trainable_variables})}
    if t2_file is not None:
        t2 = tnt.models.load_model(t2_file / "tp.keras", parallel_strategy=tnt.ParallelStrategy.TENSOR,
                                   tensor_parallel_size=3,  # the small vocabulary split too
                                   tensor_parallel_plan=TP.plan(block(0), tensor_parallel_size=3, min_split_params=0))
        out["t2_file_plan"] = t2.plan.split_layers()
        out["t2_file_predict_diff"] = _job.max_abs_diff(np.load(t2_file / "tp_predict_serial.npy"),
                                                        t2.predict(np.load(t2_file / "tp_x.npy"), verbose=0))
    return out


def main_t3(out: Path, t2_file: Path | None) -> None:
    """The 3-rank launch: mlp3 trained at t = 3 against serial Keras, and loading at q = 3."""
    cases = {}
    for name, (kind, opt, batch, n, epochs, tol_l, tol_w) in CASES_T3.items():
        cases[name] = run_case(kind, opt, batch, n, epochs, 3)
        cases[name].update(tol_loss=tol_l, tol_weights=tol_w)
    # jit_compile=True: XLA compiles the segments between the collectives (auto-clustering,
    # only inside tnt's fit/evaluate/predict); same tolerances as without.
    kind, opt, batch, n, epochs, tol_l, tol_w = CASES_T3["mlp3_adam"]
    before = clustered_graphs()
    cases["mlp3_adam_jit"] = run_case(kind, opt, batch, n, epochs, 3, jit=True)
    cases["mlp3_adam_jit"].update(tol_loss=tol_l, tol_weights=tol_w,
                                  clustered_graphs=tnt_comm.allgather_object(clustered_graphs() - before),
                                  clustered_before=before, jit_setting_after=tf.config.optimizer.get_jit())
    shutil.rmtree(XLA_DUMPS, ignore_errors=True)
    loading = t3_load_checks(out.parent, t2_file)
    # the launch's whole CPU time (TensorFlow import included), summed over the ranks
    loading["cpu_seconds_all_ranks"] = sum(tnt_comm.allgather_object(time.process_time()))
    _job.write(out, {"ranks": 3, "checks": CHECKS, "cases": cases, "loading": loading})


def drifted_whole_copy_check() -> None:
    """The group check sees a whole copy inside a split layer (mlp's row-split ``down1``
    bias) drift on one rank, as a rank-local step decision would make it."""
    _, model, _, _ = TRAINED["mlp", "adam"]
    bias = next(v for v in model.local_model.get_layer("down1").weights if v.path.endswith("bias"))
    before = bias.numpy()
    if tnt.get_rank() == 1:
        bias.assign(before + 1.0)
    try:
        model.verify_group()
        message = ""
    except TP.TensorParallelError as err:
        message = str(err)
    finally:
        bias.assign(before)
    messages = tnt_comm.allgather_object(message)
    check("verify_group_sees_a_drifted_whole_copy_in_a_split_layer",
          all("replicated weights differ" in m for m in messages), messages)


def main() -> None:
    args = sys.argv[1:]
    t2_file = Path(args[args.index("--t2-file") + 1]) if "--t2-file" in args else None
    sys.argv = [sys.argv[0], *args[:2]]
    out = _job.out_path()
    t = tnt.get_size()
    if t == 3:
        main_t3(out, t2_file)
        return
    plan_and_error_checks(t)
    unseeded_shuffle_check(t)
    deferred_build_check(t)
    loss_scale_check(t)
    cases = {}
    work = out.parent
    seconds = {}
    for name, (kind, opt, batch, n, epochs, tol_l, tol_w) in CASES.items():
        with Clock(seconds, "checkpointed_case" if name == "mlp_adam" else name):
            cases[name] = run_case(kind, opt, batch, n, epochs, t,
                                   callbacks=checkpoint_callbacks(work) if name == "mlp_adam" else None)
        cases[name].update(tol_loss=tol_l, tol_weights=tol_w)
    drifted_whole_copy_check()
    with Clock(seconds, "save_load"):
        saving = save_load_checks(t, work)
    with Clock(seconds, "streamed_save_memory"):
        saving.update(streamed_save_memory_check(t, work))
    with Clock(seconds, "checkpoint"):
        saving.update(checkpoint_checks(t, work))
    saving["seconds"] = {k: (wall, max(tnt_comm.allgather_object(cpu))) for k, (wall, cpu) in seconds.items()}
    _job.write(out, {"ranks": t, "checks": CHECKS, "cases": cases, "saving": saving})


if __name__ == "__main__":
    main()
