"""Sharded data parallelism (tnt.Model(sharding=1|2|3)) against serial Keras in the same job.

Level 3: SGD-momentum and Adam (global_clipnorm) against serial Keras with evaluate and
predict, then *_on_batch, and what each rank stores; BatchNormalization, Dropout and a
weighted layer with its own random mask against level 2; its file read serially and resumed
with sharding=3, and its BackupAndRestore backup (left in --shared by the 2-rank launch)
resumed at level 3 on 3 ranks; mixed_float16 with a LossScaleOptimizer skipping some steps.
A model built under tnt.deferred_variables() at level 3 (3 ranks): which trainable variables
each rank ever materialised, their initial values, one epoch against serial Keras.

Cases: levels 1 and 2 with SGD-momentum, Adam, Adam with global_clipnorm (clipping active)
and a LossScaleOptimizer; each compares History and weights with serial Keras, checks the
replicas hold identical weights and that each holds only its owned variables' optimizer
slots. Files: a level-2 model saved at this number of ranks loads in serial Keras with serial
Keras' weights and optimizer state, and loaded again with sharding=1 continues as serial
Keras continues. Errors: level 3 read outside a step, a bad level, an optimizer not known to be per-variable,
sharding= with another strategy. ALL (4 ranks: 2 pipeline stages x 2 replicas, Adam): levels
1 and 2 against serial Keras, replicas of a stage bitwise alike, slots per rank, the saved
file read by serial Keras, and (level 2) loaded at level 1 and trained on as serial Keras;
level 3 (the stage's weights gathered per step): what each rank stores, a read outside a step,
evaluate and predict, its file loaded at level 3 and evaluated, against serial Keras.
ALL of tensor groups without stages (4 ranks: t = 2 x 2 replicas, Adam, level 2, a vocab-split
Embedding with sparse gradients): History and weights against serial Keras, replicas of a
shard SHA-256 alike, slots partitioned per shard, the saved file read by serial Keras, and
loaded at level 1 into the same layout (weights and each rank's slots as held).
Own train_step at levels 1-3 (own_* cases, _sharded_own_step.py): one optimizer (Adam,
global_clipnorm) and a GAN's two optimizers against serial Keras, each optimizer's slots per rank;
at level 3 (weights gathered per step) the elements each rank stores between steps.
Rank 0 writes the JSON that tests/test_sharded.py checks.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import time
from pathlib import Path

import _job
import keras
import numpy as np
from _sharded_own_step import OWN_STEP_CASES, own_step_case

import tarantella as tnt
import tnt_comm
from tarantella._core.serial_files import optimizer_keys

EPOCHS, BATCH = 2, 10


def make_model(kind: str = "") -> keras.Model:
    keras.utils.set_random_seed(7)
    if kind.endswith("_seq"):
        # A Dense on a 3-D input: its kernel's gradient has shape (None, 13) in the graph,
        # which level 2's reduce-scatter once could not size (TypeError while tracing).
        return keras.Sequential([keras.Input((16,)), keras.layers.Reshape((4, 4)),
                                 keras.layers.Dense(13, activation="tanh"), keras.layers.Flatten(),
                                 keras.layers.Dense(3)])
    # Uneven variable sizes: the byte shares differ across replicas.
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(13, activation="tanh"),
        keras.layers.Dense(7, activation="tanh"),
        keras.layers.Dense(3),
    ])


def optimizer(kind: str):
    return {
        "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
        "adam_seq": lambda: keras.optimizers.Adam(0.01),
        "adam_clip": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
        # A scale near float32's limit and large targets (data("lso_sgd")): some steps overflow
        # in some variables only, so replicas owning other variables must still skip them.
        "lso_sgd": lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.01, momentum=0.9), initial_scale=2.0**125, dynamic_growth_steps=2),
    }[kind]()


def data(kind: str = ""):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(46, 16)).astype("float32")  # last batch of 6; 10 % 3 != 0
    y = rng.normal(size=(46, 3)).astype("float32") * (30.0 if kind.startswith("lso") else 1.0)
    return x, y


def elements(variables) -> int:
    return int(sum(np.prod(v.shape) for v in variables))


def digest(model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


def serial_run(kind: str, epochs: int = EPOCHS):
    x, y = data(kind)
    serial = make_model(kind)
    serial.compile(optimizer(kind), "mse")
    history = serial.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0).history
    return serial, history


def initial_gradient_norm() -> float:
    """The global norm of the first step's gradient (the clip threshold must be below it)."""
    import tensorflow as tf

    x, y = data()
    model = make_model()
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y[:BATCH], model(x[:BATCH]))
    grads = tape.gradient(loss, model.trainable_variables)
    return float(tf.linalg.global_norm(grads))


#: Cases run with a fusion threshold of 512 bytes: their sharded collectives move the
#: model's variables in several buckets (the default 8 MiB holds this model in one).
SMALL_BUCKETS = {"l2_adam_clip", "l1_lso_sgd", "l2_sgd_momentum", "all_l2_adam_clip", "all_l3_adam_clip",
                 "all_tensor_l2_adam", "all_tensor_l3_adam"}


def bucket_threshold(name: str) -> None:
    """TNT_FUSION_THRESHOLD for case ``name`` (read when its tnt.Model is made)."""
    if name in SMALL_BUCKETS:
        os.environ["TNT_FUSION_THRESHOLD"] = "0.5"
    else:
        os.environ.pop("TNT_FUSION_THRESHOLD", None)


def fit_spec(x, y):
    """The elements fit hands a multi-rank step: the rank's batch and its step sizes (without
    them the step first sums the ranks' sizes: Note [Global batch first])."""
    import tensorflow as tf

    import tnt_data

    batch = (tf.TensorSpec((None, *x.shape[1:]), tf.float32), tf.TensorSpec((None, *y.shape[1:]), tf.float32))
    return (batch, tnt_data.StepSizes(tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64)))


def scatter_graph(tm, x, y) -> dict:
    """Level 2's reduce-scatters in a traced training step (Note [Reduce-scatter during backprop]):
    how many, and what each waits for in the step graph. Overlap with backprop needs the first
    free of the fused allreduce's waits and of control inputs (tf.function's side-effect
    chain would order it after the whole local part), and the others in one chain."""
    import tensorflow as tf

    graph = tf.function(tm._tnt_steps.train_step, autograph=False).get_concrete_function(fit_spec(x, y)).graph

    def upstream(op) -> set:
        """Every op ``op`` waits for, through data and control inputs."""
        seen, todo = set(), [op]
        while todo:
            cur = todo.pop()
            for parent in [t.op for t in cur.inputs] + list(cur.control_inputs):
                if parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        return seen

    scatters = [op for op in graph.get_operations() if "tnt_shard_reduce_scatter" in op.name]
    before = {op.name: upstream(op) for op in scatters}
    # Note [Level 2's updates released in step]: per owned position, the reduce-scatters its
    # update's input waits for, beside the release point the plan names (its bucket's index + 1).
    from tarantella.data_parallel._update_release import release_buckets

    sharding = tm._tnt_sharding
    variables = tm.trainable_variables
    dense = [i for i in range(len(variables)) if i not in (tm._tnt_steps._sparse_positions or ())]
    buckets = [idx for _, idx in sharding.scatter_buckets(dense)]
    own_bucket = {i: k for k, idx in enumerate(buckets) for i in idx}
    plan = release_buckets(buckets, sharding.owners, [int(np.prod(v.shape)) for v in variables], sharding.size)
    releases = {}
    for op in graph.get_operations():
        if op.type == "Identity" and op.name.rsplit("/", 1)[-1].startswith("tnt_shard_release_"):
            i = int(op.name.rsplit("_", 1)[-1])
            releases[i] = [sum("tnt_shard_reduce_scatter" in a.name for a in upstream(op)), plan[i] + 1,
                           own_bucket[i] + 1]
    first = [op for op in scatters if not any("tnt_shard_reduce_scatter" in a.name for a in before[op.name])]
    return {
        "count": len(scatters),
        "first_count": len(first),
        "first_after_fused_wait": any("tnt_wait" in a.name for op in first for a in before[op.name]),
        "first_control_inputs": sum(len(op.control_inputs) for op in first),
        "scatters_before_each": sorted(sum("tnt_shard_reduce_scatter" in a.name for a in before[op.name])
                                       for op in scatters),
        "releases": tnt_comm.allgather_object(releases),  # per rank: [waits for, planned, own bucket]
    }


def update_graph(tm, model) -> list[dict]:
    """Per rank, level 2's update in each traced global step (Note [Level 2's update bucket by bucket]):
    per owned variable (in update order) whether its writes wait for the previous one's (one
    variable's temporaries at a time), and which owned variables' writes the first allgather
    of values waits for (the first bucket's only). Counted from the graph's dependencies, per
    concrete function."""
    sharding = tm._tnt_sharding
    owned = sharding.owned_mask()
    early = sharding.updates_during_backprop(model.optimizer)  # Note [Level 2's update during backprop]
    order = [i for i in sharding._update_order(early) if owned[i]]
    first_bucket = sorted(i for i in sharding._groups()[0][1] if owned[i])
    variables = model.trainable_variables
    out = []
    for fn in tm._tnt_steps._compiled_fns[("global", False)]._list_all_concrete_functions():
        ops, cache = fn.graph.get_operations(), {}
        inner = {id(ext): internal.op for ext, internal in fn.graph.captures}
        writes = {}
        for i in order:
            handle = inner.get(id(variables[i].value.handle))
            writes[i] = {o.name for o in ops if o.inputs and o.inputs[0].op is handle
                         and (o.type.startswith("Assign") or o.type.startswith("ResourceApply"))}
        gathers = [o for o in ops if "tnt_shard_allgather" in o.name]
        first = min(gathers, key=lambda o: len(_ancestors(o, cache)))
        before_first = _ancestors(first, cache)
        by_name = {o.name: o for o in ops}
        chained = sum(all(writes[a] <= _ancestors(by_name[w], cache) for w in writes[b])
                      for a, b in itertools.pairwise(order) if writes[a] and writes[b])
        # The global part's inputs named ``after``: the last reduce-scatter's token (and the
        # sparse gathers'); an update waiting for one cannot run during backprop.
        after = {o.name for o in ops if o.type == "Placeholder" and o.name.startswith("after")}
        waiting = sum(any(after & _ancestors(by_name[w], cache) for w in writes[i]) for i in order)
        # Each allgather after the previous bucket's writes of received values (one at a time).
        gathers = sorted(gathers, key=lambda o: len(_ancestors(o, cache)))
        received = []
        for _, idx in sharding._groups():
            handles = {inner.get(id(variables[i].value.handle)) for i in idx if not owned[i]}
            received.append({o.name for o in ops if o.type == "AssignVariableOp" and o.inputs[0].op in handles})
        pairs = [(w, g) for w, g in zip(received, gathers[1:]) if w]
        out.append({"owned": len(order), "written": sum(bool(writes[i]) for i in order),
                    "chained": chained, "first_bucket": first_bucket, "early": early,
                    "after_inputs": len(after), "writes_after_last_scatter": waiting,
                    "gathers_after_received_writes": [sum(w <= _ancestors(g, cache) for w, g in pairs), len(pairs)],
                    "before_first_gather": sorted(i for i in order if writes[i] & before_first)})
    return tnt_comm.allgather_object(out)  # per rank: each owns other variables


def stored_elements(model, shards) -> int:
    """Trainable elements this rank stores (level 3 releases the ones other replicas own)."""
    return elements([v for v in model.trainable_variables if shards is None or not shards.is_released(v)])


def case(level: int, kind: str) -> dict:
    bucket_threshold(f"l{level}_{kind}")
    x, y = data(kind)
    serial, serial_history = serial_run(kind)
    model = make_model(kind)
    tm = tnt.Model(model, sharding=level)
    tm.compile(optimizer(kind), "mse")
    history = tm.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    sharding = tm._tnt_sharding
    # Optimizer steps applied (a LossScaleOptimizer skips overflowing ones) of all steps.
    applied = [int(model.optimizer.iterations.numpy()), int(serial.optimizer.iterations.numpy())]
    slot_elements = tnt_comm.allgather_object(elements(model.optimizer.variables))
    # Level 3 keeps no whole copy: the tnt.Model's get_weights() gathers it from the owners.
    weights = tm.get_weights()
    weight_diff = _job.max_abs_diff(weights, serial.get_weights())  # before level 3's *_on_batch steps
    h = hashlib.sha256()
    for w in weights:
        h.update(np.ascontiguousarray(w).tobytes())
    out = {}
    if level == 2:
        out["scatter_graph"] = scatter_graph(tm, x, y)
        out["update_graph"] = update_graph(tm, model)
    if level == 3:  # held only by owners; evaluate and predict gather per layer too
        out["stored_elements_per_rank"] = tnt_comm.allgather_object(stored_elements(model, sharding.layers))
        out["owned_elements_per_rank"] = tnt_comm.allgather_object(elements(sharding.owned_variables()))
        out["evaluate_diff"] = _job.max_abs_diff(tm.evaluate(x, y, batch_size=BATCH, verbose=0),
                                                 serial.evaluate(x, y, batch_size=BATCH, verbose=0))
        out["predict_diff"] = _job.max_abs_diff(tm.predict(x, batch_size=BATCH, verbose=0),
                                                serial.predict(x, batch_size=BATCH, verbose=0))
        out.update(_job.timed(f"l{level}_{kind} *_on_batch", lambda: on_batch(tm, serial, x, y)))
        out["prefetch"] = prefetch_structure(tm)
    return {
        **out,
        "history_diff": _job.max_abs_diff(history["loss"], serial_history["loss"]),
        "weight_diff": weight_diff,
        "replicas_identical": len(set(tnt_comm.allgather_object(h.hexdigest()))) == 1,
        "slot_elements_per_rank": slot_elements,
        "serial_slot_elements": elements(serial.optimizer.variables),
        "variable_elements": elements(model.trainable_variables),
        "bytes_per_rank": sharding.bytes_per_rank(),
        "buckets": sharding.bucket_count(),
        "owned_per_rank": tnt_comm.allgather_object(len(sharding.owned_variables())),
        "initial_gradient_norm": initial_gradient_norm(),
        "applied_steps": applied,
        "steps": EPOCHS * -(-len(x) // BATCH),
    }


def _ancestors(op, cache: dict) -> set[str]:
    """Names of every op ``op`` depends on (data and control inputs, transitively)."""
    if op.name not in cache:
        seen, stack = set(), [op]
        while stack:
            o = stack.pop()
            for p in [i.op for i in o.inputs] + list(o.control_inputs):
                if p.name not in seen:
                    seen.add(p.name)
                    stack.append(p)
        cache[op.name] = seen
    return cache[op.name]


def prefetch_structure(tm) -> list[dict]:
    """Level 3's prefetch in each traced step (docs/sharding.md, "Level 3", Prefetch): every
    prefetched gather, started right after another one's wait, must (overlapped) be a
    dependency of a MatMul computing with the waited weights, so it is in flight while they
    compute, and (bounded) its own wait must come after such a MatMul, so no gather runs
    more than one layer ahead. Counted from the graph's dependencies, per concrete function."""
    out = []
    for fn in tm._tnt_steps._compiled_fns[("local", False)]._list_all_concrete_functions():
        ops, cache = fn.graph.get_operations(), {}
        chain = [o for o in ops if "tnt_shard3_allgather_" in o.name]
        waits = [o for o in chain if "allgather_wait" in o.name]
        matmuls = [o for o in ops if o.type == "MatMul"]
        pairs = overlapped = bounded = 0
        for w, s in itertools.pairwise(chain):
            if "allgather_prefetch" not in s.name:
                continue
            assert "allgather_wait" in w.name, (w.name, s.name)  # a prefetch follows a wait
            pairs += 1
            w2 = next(o for o in waits if o.inputs[0].op is s)  # the wait of the prefetched gather
            uses = [m for m in matmuls if w.name in _ancestors(m, cache) and w2.name not in _ancestors(m, cache)]
            overlapped += any(s.name in _ancestors(m, cache) for m in uses)
            bounded += any(m.name in _ancestors(w2, cache) for m in uses)
        out.append({"waits": len(waits), "starts": sum("allgather_start" in o.name for o in chain),
                    "prefetches": pairs, "overlapped": overlapped, "bounded": bounded})
    return out


def on_batch(tm, serial, x, y) -> dict:
    """After the level-3 fit, evaluate and predict (weights equal to serial Keras'): two
    train_on_batch of global batches of 10 and 6 rows (the shapes fit traced, uneven on 3
    ranks), then test_on_batch and predict_on_batch, each against serial Keras."""
    train = [_job.max_abs_diff(tm.train_on_batch(x[lo:hi], y[lo:hi]), serial.train_on_batch(x[lo:hi], y[lo:hi]))
             for lo, hi in ((0, 10), (40, 46))]
    return {
        "train_on_batch_diff": train,
        "test_on_batch_diff": _job.max_abs_diff(tm.test_on_batch(x[10:20], y[10:20]),
                                                serial.test_on_batch(x[10:20], y[10:20])),
        "predict_on_batch_diff": _job.max_abs_diff(tm.predict_on_batch(x[20:30]), serial.predict_on_batch(x[20:30])),
        "on_batch_weight_diff": _job.max_abs_diff(tm.get_weights(), serial.get_weights()),
        "on_batch_applied_steps": [int(tm.model.optimizer.iterations.numpy()), int(serial.optimizer.iterations.numpy())],
    }


class NoisyDense(keras.layers.Dense):
    """A Dense with a seeded dropout inside its own call: level 3 recomputes the call in
    backprop, which must draw the forward's mask again (its seed state mapped as read)."""

    def build(self, input_shape):
        super().build(input_shape)
        self.noise_seed = keras.random.SeedGenerator(11)

    def call(self, inputs, training=None):
        out = super().call(inputs)
        return keras.random.dropout(out, 0.3, seed=self.noise_seed) if training else out


def bn_model() -> keras.Model:
    keras.utils.set_random_seed(7)
    return keras.Sequential([
        keras.Input((16,)), NoisyDense(13, activation="tanh"), keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.2, seed=5), keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)])


def l3_vs_l2_case() -> dict:
    """BatchNormalization, Dropout and a weighted layer drawing its own random mask: level 3
    against level 2 in the same job (local batch statistics and per-rank dropout masks make
    both differ from serial Keras alike), weights with the moving statistics, History and
    predict (evaluate is compared with serial Keras in the level-3 cases)."""
    x, y = data()
    runs = {}
    for level in (2, 3):
        os.environ.pop("TNT_FUSION_THRESHOLD", None)
        tm = tnt.Model(bn_model(), sharding=level)
        tm.compile(optimizer("adam"), "mse")
        # One epoch (suite time): 5 steps, the last of 6 samples.
        history = tm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
        runs[level] = (history["loss"], tm.get_weights(), None, tm.predict(x, batch_size=BATCH, verbose=0),
                       sorted(tm._tnt_sharding.layers.per_layer_positions()) if level == 3 else None)
    return {
        "history_diff": _job.max_abs_diff(runs[3][0], runs[2][0]),
        "weight_diff": _job.max_abs_diff(runs[3][1], runs[2][1]),
        "predict_diff": _job.max_abs_diff(runs[3][3], runs[2][3]),
        "per_layer_positions": runs[3][4],
        "weights": len(runs[3][1]),
    }


def shared_call_model() -> keras.Model:
    """One Dense called twice in a row: the first trace predicts the plan's order (each layer
    once), so two prefetched gathers are of the wrong layer and dropped."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((16,))
    twice = keras.layers.Dense(16, activation="tanh", name="twice")
    h = keras.layers.Dense(7, activation="tanh", name="mid")(twice(twice(inp)))
    return keras.Model(inp, keras.layers.Dense(3, name="head")(h))


def l3_shared_call_case() -> dict:
    """Level 3 with wrong prefetch guesses against serial Keras (one epoch, Adam)."""
    x, y = data()
    serial = shared_call_model()
    serial.compile(optimizer("adam"), "mse")
    serial_history = serial.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    tm = tnt.Model(shared_call_model(), sharding=3)
    tm.compile(optimizer("adam"), "mse")
    history = tm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    return {"history_diff": _job.max_abs_diff(history["loss"], serial_history["loss"]),
            "weight_diff": _job.max_abs_diff(tm.get_weights(), serial.get_weights()),
            "predict_diff": _job.max_abs_diff(tm.predict(x, batch_size=BATCH, verbose=0),
                                              serial.predict(x, batch_size=BATCH, verbose=0)),
            "prefetch": prefetch_structure(tm),
            "order": [layer.name for layer in tm._tnt_sharding.layers._order]}


def l3_files_case(tmp, shared) -> dict:
    """Level 3: save -> serial Keras load equals the serial run; tnt.models.load_model(...,
    sharding=3) continues as serial Keras continues. Its fit also keeps a BackupAndRestore
    backup of the epoch in the session's shared folder: the 3-rank launch resumes it at level 3
    (l3_backup_resume) against serial Keras' second epoch, left beside it."""
    x, y = data()
    path = str(tmp / "sharded_l3.keras")
    folder = _backup_folder(shared)
    if tnt.is_master_rank():
        shutil.rmtree(folder, ignore_errors=True)
    tnt_comm.barrier()
    serial, _ = serial_run("adam", epochs=1)
    tm = tnt.Model(make_model(), sharding=3)
    tm.compile(optimizer("adam"), "mse")
    tm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
           callbacks=[keras.callbacks.BackupAndRestore(str(folder / "d2"), delete_checkpoint=False)])
    tm.save(path)
    tnt_comm.barrier()
    loaded = keras.models.load_model(path)
    out = {
        "loaded_weight_diff": _job.max_abs_diff(loaded.get_weights(), serial.get_weights()),
        "loaded_optimizer_count": [len(loaded.optimizer.variables), len(serial.optimizer.variables)],
        "loaded_optimizer_diff": _job.max_abs_diff([v.numpy() for v in loaded.optimizer.variables],
                                                   [v.numpy() for v in serial.optimizer.variables]),
    }
    resumed = tnt.models.load_model(path, sharding=3)
    resumed.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    second = serial.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    out["resumed_weight_diff"] = _job.max_abs_diff(resumed.get_weights(), serial.get_weights())
    shards = resumed._tnt_sharding.layers
    out["resumed_stored_elements_per_rank"] = tnt_comm.allgather_object(stored_elements(resumed.model, shards))
    if tnt.is_master_rank():  # serial Keras' second epoch, for the 3-rank resume to compare with
        np.savez(folder / "serial_epoch_2.npz", loss=np.asarray(second["loss"]),
                 **{f"w{i}": w for i, w in enumerate(serial.get_weights())})
    tnt_comm.barrier()
    return out


def l3_mixed_case() -> dict:
    """mixed_float16 at level 3 (float16 compute, float32 variables gathered per layer): an
    explicit LossScaleOptimizer(SGD momentum) whose scale overflows float16 in some steps (large
    targets), against serial Keras under the same policy; the loss scale, the steps applied and
    the weights. One epoch (5 steps, the last of 6 samples)."""
    x, y = data("lso")

    def lso():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01, momentum=0.9),
                                                   initial_scale=2.0**15, dynamic_growth_steps=2)

    keras.config.set_dtype_policy("mixed_float16")
    try:
        serial = make_model()
        serial.compile(lso(), "mse")
        serial_history = serial.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
        model = make_model()
        tm = tnt.Model(model, sharding=3)
        tm.compile(lso(), "mse")
        history = tm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
        weights = tm.get_weights()
    finally:
        keras.config.set_dtype_policy("float32")
    return {
        "compute_dtype": model.layers[0].compute_dtype,
        "history_diff": _job.max_abs_diff(history["loss"], serial_history["loss"]),
        "weight_diff": _job.max_abs_diff(weights, serial.get_weights()),
        "replicas_identical": len(set(tnt_comm.allgather_object(hashlib.sha256(
            b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()))) == 1,
        "loss_scale": [float(model.optimizer.dynamic_scale.numpy()), float(serial.optimizer.dynamic_scale.numpy())],
        "applied_steps": [int(model.optimizer.iterations.numpy()), int(serial.optimizer.iterations.numpy())],
        "steps": -(-len(x) // BATCH),
        "stored_elements_per_rank": tnt_comm.allgather_object(stored_elements(model, tm._tnt_sharding.layers)),
    }


def _backup_folder(shared) -> Path:
    return Path(shared) / "sharded_l3_backup"


def l3_backup_resume_case(shared) -> dict:
    """The 2-rank launch's level-3 BackupAndRestore backup (l3_files, one epoch) resumed here at
    level 3 on 3 ranks: the second epoch against serial Keras' (computed there)."""
    x, y = data()
    folder = _backup_folder(shared)
    if not (folder / "serial_epoch_2.npz").exists():
        return {"missing": str(folder)}
    tnt_comm.barrier()
    if tnt.is_master_rank():  # resume a copy: the 2-rank launch's backup stays as written
        shutil.rmtree(folder / "d3", ignore_errors=True)
        shutil.copytree(folder / "d2", folder / "d3")
    tnt_comm.barrier()
    serial = np.load(folder / "serial_epoch_2.npz")
    model = make_model()
    tm = tnt.Model(model, sharding=3)
    tm.compile(optimizer("adam"), "mse")
    h = tm.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
               callbacks=[keras.callbacks.BackupAndRestore(str(folder / "d3"))])
    weights = tm.get_weights()
    return {
        "resumed_epochs": h.epoch,
        "history_diff": _job.max_abs_diff(h.history["loss"], list(serial["loss"])),
        "weight_diff": _job.max_abs_diff(weights, [serial[f"w{i}"] for i in range(len(weights))]),
        "iterations": int(model.optimizer.iterations.numpy()),
        "stored_elements_per_rank": tnt_comm.allgather_object(stored_elements(model, tm._tnt_sharding.layers)),
    }

def deferred_model() -> keras.Model:
    """make_model's with an L2-regularized middle layer (kept whole at level 3): built eagerly
    for serial Keras, and under tnt.deferred_variables() for level 3."""
    keras.utils.set_random_seed(7)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(13, activation="tanh"),
        keras.layers.Dense(7, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-3)),
        keras.layers.Dense(3),
    ])


def l3_deferred_case() -> dict:
    """Level 3 of a model built under tnt.deferred_variables(): which trainable variables each
    rank ever gave memory to (every Keras variable gets it through ``_initialize``, recorded
    from the wrap to the end of fit), that those hold the eager build's values bitwise, and
    one epoch against serial Keras built eagerly from the same seed."""
    x, y = data()
    serial = deferred_model()
    initial = [v.numpy() for v in serial.trainable_variables]
    serial.compile(optimizer("adam"), "mse")
    serial_history = serial.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    with tnt.deferred_variables():
        model = deferred_model()
    index = {id(v): i for i, v in enumerate(model.trainable_variables)}
    made: list[int] = []  # positions of the trainable variables given memory on this rank
    cls = type(model.trainable_variables[0])
    original = cls._initialize

    def recording(variable, value):
        if id(variable) in index:
            made.append(index[id(variable)])
        return original(variable, value)

    cls._initialize = recording
    try:
        tm = tnt.Model(model, sharding=3)
        shards = tm._tnt_sharding.layers
        held = [i for i, v in enumerate(model.trainable_variables) if not shards.is_released(v)]
        initial_equal = all(np.array_equal(model.trainable_variables[i].numpy(), initial[i]) for i in held)
        tm.compile(optimizer("adam"), "mse")
        history = tm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    finally:
        cls._initialize = original
    return {
        "materialised_per_rank": tnt_comm.allgather_object(sorted(set(made))),
        "materialised_elements_per_rank": tnt_comm.allgather_object(
            elements([model.trainable_variables[i] for i in sorted(set(made))])),
        "stored_elements_per_rank": tnt_comm.allgather_object(stored_elements(model, shards)),
        "initial_bitwise_equal_per_rank": tnt_comm.allgather_object(initial_equal),
        "variables": len(model.trainable_variables),
        "history_diff": _job.max_abs_diff(history["loss"], serial_history["loss"]),
        "weight_diff": _job.max_abs_diff(tm.get_weights(), serial.get_weights()),
    }


def files_case(tmp) -> dict:
    """Level 2 at this d: save (and BackupAndRestore's file) -> serial Keras load equals the
    serial run (weights and the whole optimizer state); load with sharding=1 and continue =
    serial continuation."""
    x, y = data()
    path = str(tmp / "sharded_l2.keras")
    serial, _ = serial_run("adam")
    model = make_model()
    tm = tnt.Model(model, sharding=2)
    tm.compile(optimizer("adam"), "mse")
    backup_dir = tmp / "backup"
    if tnt.is_master_rank():
        shutil.rmtree(backup_dir, ignore_errors=True)
    tnt_comm.barrier()
    backup = keras.callbacks.BackupAndRestore(str(backup_dir), delete_checkpoint=False)
    tm.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[backup])
    tm.save(path)
    tnt_comm.barrier()
    # BackupAndRestore's file of the last epoch, read by serial Keras: the whole state too.
    from_backup = make_model()
    from_backup.compile(optimizer("adam"), "mse")
    from_backup.optimizer.build(from_backup.trainable_variables)
    from_backup.load_weights(str(sorted(backup_dir.glob("*.weights.h5"))[0]))
    loaded = keras.models.load_model(path)
    out = {
        "loaded_weight_diff": _job.max_abs_diff(loaded.get_weights(), serial.get_weights()),
        "loaded_optimizer_count": [len(loaded.optimizer.variables), len(serial.optimizer.variables)],
        "loaded_optimizer_diff": _job.max_abs_diff([v.numpy() for v in loaded.optimizer.variables],
                                                   [v.numpy() for v in serial.optimizer.variables]),
        "backup_weight_diff": _job.max_abs_diff(from_backup.get_weights(), serial.get_weights()),
        "backup_optimizer_diff": _job.max_abs_diff([v.numpy() for v in from_backup.optimizer.variables],
                                                   [v.numpy() for v in serial.optimizer.variables]),
    }
    resumed = tnt.models.load_model(path, sharding=1)
    resumed.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    serial.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    out["resumed_weight_diff"] = _job.max_abs_diff(resumed.get_weights(), serial.get_weights())
    out["resumed_slot_elements_per_rank"] = tnt_comm.allgather_object(elements(resumed.model.optimizer.variables))
    out["resumed_replicas_identical"] = len(set(tnt_comm.allgather_object(digest(resumed.model)))) == 1
    return out


class NotPerVariable(keras.optimizers.SGD):
    """A subclass: tnt cannot know its update stays per variable."""


class SubsetStep(keras.Sequential):
    """An own train_step applying the compiled optimizer (its slots built on the owned share of
    all trainable variables) to the first layer's only: refused at levels 1-2 (error_cases)."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        first = self.layers[0].trainable_variables
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, first), first))
        return {}


def error_cases() -> dict:
    x, y = data()

    def raised(fn, *needles) -> dict:
        try:
            fn()
        except Exception as e:  # the type and message are what is checked
            msg = f"{type(e).__name__}: {e}"
            return {"ok": all(n in msg for n in needles), "detail": msg[:400]}
        return {"ok": False, "detail": "no error"}

    def compiled_subset():
        keras.utils.set_random_seed(7)
        tm = tnt.Model(SubsetStep([keras.Input((16,)), keras.layers.Dense(13), keras.layers.Dense(3)]), sharding=1)
        tm.compile(keras.optimizers.Adam(0.01))
        tm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)

    def compiled(opt):
        tm = tnt.Model(make_model(), sharding=1)
        tm.compile(opt, "mse")
        tm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)

    return {
        "level_3_read_outside_a_step": raised(lambda: level_3_read(x, y), "ShardingError", "sharding=3",
                                              "get_weights()", "sharding<=2"),
        "level_3_sync_batch_norm": raised(lambda: tnt.Model(bn_model(), sync_batch_norm=True, sharding=3),
                                          "ShardingError", "sync_batch_norm=False", "sharding=2"),
        "own_step_optimizer_on_other_variables": raised(lambda: compiled_subset(), "ShardingError", "Adam",
                                                        "same variables", "sharding=0"),
        "bad_level": raised(lambda: tnt.Model(make_model(), sharding=7), "sharding=7", "0 (none)"),
        "optimizer_not_per_variable": raised(lambda: compiled(NotPerVariable(0.1)), "NotPerVariable",
                                             "sharding=0", "tnt_per_variable"),
        "other_strategy": raised(lambda: tnt.Model(make_model(), parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                                                   num_pipeline_stages=2, sharding=1), "sharding", "DATA"),
    }


def level_3_read(x, y) -> None:
    """Reading the wrapped model's weights directly once level 3 released them (a built model
    is synchronised, then released, when it is wrapped)."""
    tnt.Model(make_model(), sharding=3).model.get_weights()


def all_case(level: int, kind: str, tmp) -> dict:
    """ALL, 2 stages x 2 replicas at ``level`` with optimizer ``kind`` (Adam, with or without an
    active global_clipnorm), against serial Keras (one epoch: 5 steps, the last of 6 samples)."""
    start = time.perf_counter()
    bucket_threshold(f"all_l{level}_{kind}")
    x, y = data()
    serial, serial_history = serial_run(kind, epochs=1)
    tm = tnt.Model(make_model(), parallel_strategy=tnt.ParallelStrategy.ALL, num_pipeline_stages=2,
                   num_micro_batches=2, sharding=level)
    tm.compile(optimizer(kind), "mse")
    history = tm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    stage_runtime = tm._tnt_stage
    optimizer_vars = stage_runtime.optimizer.variables
    shards = stage_runtime.shards
    weights = tm.get_weights()
    with tm._tnt_whole():  # level 3: the stage's weights gathered from their owners meanwhile
        stage_digest = digest(tm.stage_model)
    out = {
        "strategy": type(tm).__name__,
        "history_diff": _job.max_abs_diff(history["loss"], serial_history["loss"]),
        "weight_diff": _job.max_abs_diff(weights, serial.get_weights()),
        "weights_digest": hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest(),
        # (stage, replica, digest of the stage's weights) of every rank
        "stage_digests": tnt_comm.allgather_object((tm.stage, tm.replica, stage_digest)),
        "slot_elements_per_rank": tnt_comm.allgather_object((tm.stage, elements(optimizer_vars))),
        "optimizer_bytes_per_rank": tnt_comm.allgather_object(int(sum(
            np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in optimizer_vars))),
        "stage_variable_elements": tnt_comm.allgather_object((tm.stage, elements(tm.stage_model.trainable_variables))),
        "owned_per_rank": tnt_comm.allgather_object(None if shards is None else len(shards.owned(shards.owners))),
        "buckets_per_rank": tnt_comm.allgather_object(
            None if shards is None else shards.bucket_count(tm.stage_model.trainable_variables)),
        "serial_slot_elements": elements(serial.optimizer.variables),
        "variable_elements": elements(serial.trainable_variables),
        "applied_steps": [int(stage_runtime.optimizer.iterations.numpy()), int(serial.optimizer.iterations.numpy())],
    }
    path = str(tmp / f"sharded_all_l{level}.keras")
    tm.save(path)
    tnt_comm.barrier()
    if tnt.is_master_rank():  # the file, read by serial Keras (rank 0 reports)
        loaded = keras.models.load_model(path)
        out["loaded_weight_diff"] = _job.max_abs_diff(loaded.get_weights(), serial.get_weights())
        out["loaded_optimizer_count"] = [len(loaded.optimizer.variables), len(serial.optimizer.variables)]
        out["loaded_optimizer_diff"] = _job.max_abs_diff([v.numpy() for v in loaded.optimizer.variables],
                                                         [v.numpy() for v in serial.optimizer.variables])
    if level == 3:
        out.update(all_level_3(tm, serial, path, x, y))
    if level == 2:  # the file loaded at level 1 trains on as serial Keras does
        resumed = tnt.models.load_model(path, parallel_strategy=tnt.ParallelStrategy.ALL, num_pipeline_stages=2,
                                        num_micro_batches=2, sharding=1)
        resumed.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        serial.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        out["resumed_weight_diff"] = _job.max_abs_diff(resumed.get_weights(), serial.get_weights())
        out["resumed_stage_digests"] = tnt_comm.allgather_object(
            (resumed.stage, resumed.replica, digest(resumed.stage_model)))
        out["resumed_slot_elements_per_rank"] = tnt_comm.allgather_object(
            (resumed.stage, elements(resumed._tnt_stage.optimizer.variables)))
    out["seconds"] = time.perf_counter() - start
    return out


def stage_stored(tm) -> tuple[int, int, int]:
    """(stage, trainable elements this rank's buffers hold, elements it owns): level 3 frees
    the others between steps (read from the buffers, not from the shapes)."""
    shards = tm._tnt_stage.shards
    variables = tm.stage_model.trainable_variables
    return tm.stage, shards.stored_bytes(variables) // 4, elements(shards.owned(variables))


def all_level_3(tm, serial, path: str, x, y) -> dict:
    """ALL at level 3: what each rank stores, a read outside tnt's steps, evaluate and predict
    against serial Keras, and its file loaded at level 3 (evaluated: synchronised, freed,
    gathered again) against serial Keras."""
    try:
        tm.stage_model.get_weights()
        read = "no error"
    except Exception as e:  # the type and message are what is checked
        read = f"{type(e).__name__}: {e}"
    out = {
        "stored_per_rank": tnt_comm.allgather_object(stage_stored(tm)),
        "read_outside_a_step": read[:400],
        "evaluate_diff": _job.max_abs_diff(tm.evaluate(x, y, batch_size=BATCH, verbose=0),
                                           serial.evaluate(x, y, batch_size=BATCH, verbose=0)),
        "predict_diff": _job.max_abs_diff(tm.predict(x, batch_size=BATCH, verbose=0),
                                          serial.predict(x, batch_size=BATCH, verbose=0)),
    }
    loaded = tnt.models.load_model(path, parallel_strategy=tnt.ParallelStrategy.ALL, num_pipeline_stages=2,
                                   num_micro_batches=2, sharding=3)
    out["loaded_evaluate_diff"] = _job.max_abs_diff(loaded.evaluate(x, y, batch_size=BATCH, verbose=0),
                                                    serial.evaluate(x, y, batch_size=BATCH, verbose=0))
    out["loaded_stored_per_rank"] = tnt_comm.allgather_object(stage_stored(loaded))
    out["loaded_slot_elements_per_rank"] = tnt_comm.allgather_object(
        (loaded.stage, elements(loaded._tnt_stage.optimizer.variables)))
    return out


def tensor_model() -> keras.Model:
    """Embedding (vocab-split: a shard's sparse gradients), a column/row Dense pair, then
    replicated layers (LayerNormalization, the head: see tensor_plan). The table's shard
    outweighs the rest, so one replica owns it alone: no dense gradient to receive, the
    case whose reduce-scatter once raced the allgather of values."""
    keras.utils.set_random_seed(7)
    return keras.Sequential([
        keras.Input((7,), dtype="int32"),
        keras.layers.Embedding(60, 8, name="t_emb"),
        keras.layers.GlobalAveragePooling1D(name="t_pool"),
        keras.layers.Dense(16, activation="relu", name="t_up"),
        keras.layers.Dense(8, name="t_down"),
        keras.layers.LayerNormalization(name="t_ln"),
        keras.layers.Dense(4, activation="softmax", name="t_head"),
    ], name="t_embed")


def tensor_plan(model: keras.Model):
    return tnt.tensor_parallel.plan(model, tensor_parallel_size=2, min_split_params=0).replicate("t_head")


def tensor_data():
    rng = np.random.default_rng(5)
    return rng.integers(0, 60, size=(46, 7)).astype("int32"), rng.integers(0, 4, size=46)


def tensor_serial(epochs: int):
    x, y = tensor_data()
    serial = tensor_model()
    serial.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    return serial, serial.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0).history


def all_tensor_level_3(tm) -> dict:
    """ALL of tensor groups at level 3 (weights gathered per step in each shard's replica
    group), right after fit: (shard, trainable elements this rank's buffers hold, elements it
    owns) of every rank, read from the buffers; and a read outside tnt's steps."""
    variables = tm.trainable_variables
    stored = tm._tnt_sharding.per_step.stored_bytes(variables) // 4  # float32
    try:
        tm.local_model.get_weights()
        read = "no error"
    except Exception as e:  # the type and message are what is checked
        read = f"{type(e).__name__}: {e}"
    return {"stored_per_rank": tnt_comm.allgather_object(
                (tm.tensor_parallel_rank, stored, elements(tm._tnt_sharding.owned_variables()))),
            "read_outside_a_step": read[:400]}


def all_tensor_case(level: int, tmp) -> dict:
    """ALL, 2 replicas of 2-rank tensor groups (no stages) at ``level``, Adam, against serial
    Keras (one epoch: 5 steps, the last of 6 samples); then its file, read by serial Keras and
    loaded at level 1."""
    start = time.perf_counter()
    bucket_threshold(f"all_tensor_l{level}_adam")
    x, y = tensor_data()
    serial, serial_history = tensor_serial(epochs=1)
    plan = tensor_plan(tensor_model())
    tm = tnt.Model(tensor_model(), parallel_strategy=tnt.ParallelStrategy.ALL, tensor_parallel_size=2,
                   tensor_parallel_plan=plan, sharding=level)
    tm.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    history = tm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    opt_vars = tm.optimizer.variables
    sharding = tm._tnt_sharding
    out = {} if level < 3 else all_tensor_level_3(tm)
    out |= {
        "strategy": type(tm).__name__,
        "buckets": sharding.bucket_count(),
        "plan": {s.name: s.kind for s in plan.layers},
        "history_diff": _job.max_abs_diff(history["loss"], serial_history["loss"]),
        "weight_diff": _job.max_abs_diff(tm.get_weights(), serial.get_weights()),
        # (shard, replica, SHA-256 of the shard's and of the replicated variables) of every rank
        "digests": tnt_comm.allgather_object((tm.tensor_parallel_rank, tm.replica, tm.shard_checksum(),
                                              tm.replicated_checksum())),
        # (shard, optimizer elements held, trainable elements of the shard's local model)
        "slots_per_rank": tnt_comm.allgather_object((tm.tensor_parallel_rank, elements(opt_vars),
                                                     elements(tm.trainable_variables))),
        "optimizer_bytes_per_rank": tnt_comm.allgather_object(int(sum(
            np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in opt_vars))),
        "owned_per_rank": tnt_comm.allgather_object(len(sharding.owned_variables())),
        "owned_paths": tnt_comm.allgather_object(sorted(v.path for v in sharding.owned_variables())),
        "trainable_paths": tnt_comm.allgather_object(sorted(v.path for v in tm.trainable_variables)),
        "serial_slot_elements": elements(serial.optimizer.variables),
        "serial_variable_elements": elements(serial.trainable_variables),
        "applied_steps": [int(tm.optimizer.iterations.numpy()), int(serial.optimizer.iterations.numpy())],
    }
    out["seconds_serial_and_fit"] = time.perf_counter() - start
    path = str(tmp / f"sharded_all_tensor_l{level}.keras")
    tm.save(path)
    tnt_comm.barrier()
    if tnt.is_master_rank():  # the file, read by serial Keras
        loaded = keras.models.load_model(path)
        out["loaded_weight_diff"] = _job.max_abs_diff(loaded.get_weights(), serial.get_weights())
        out["loaded_optimizer_count"] = [len(loaded.optimizer.variables), len(serial.optimizer.variables)]
        out["loaded_optimizer_diff"] = _job.max_abs_diff([v.numpy() for v in loaded.optimizer.variables],
                                                         [v.numpy() for v in serial.optimizer.variables])
    # Loaded into this layout at level 1 (the same owners): each rank holds the weights and the
    # slots it held after training (no second fit: its tracing would double the case's time).
    loaded = tnt.models.load_model(path, parallel_strategy=tnt.ParallelStrategy.ALL, tensor_parallel_size=2,
                                   tensor_parallel_plan=plan, sharding=1)
    held = {k: v.numpy() for k, v in zip(optimizer_keys(tm.optimizer, tm.local_model), opt_vars)}
    reread = {k: v.numpy() for k, v in zip(optimizer_keys(loaded.optimizer, loaded.local_model),
                                           loaded.optimizer.variables)}
    out["reloaded_weight_diff"] = _job.max_abs_diff(loaded.get_weights(), tm.get_weights())
    out["reloaded_slots_diff"] = tnt_comm.allgather_object(
        _job.max_abs_diff([reread[k] for k in sorted(reread)], [held[k] for k in sorted(held)])
        if sorted(reread) == sorted(held) else float("inf"))
    out["reloaded_digests"] = tnt_comm.allgather_object((loaded.tensor_parallel_rank, loaded.replica,
                                                         loaded.shard_checksum(), loaded.replicated_checksum()))
    out["reloaded_slots_per_rank"] = tnt_comm.allgather_object(
        (loaded.tensor_parallel_rank, elements(loaded.optimizer.variables), elements(loaded.trainable_variables)))
    out["seconds"] = time.perf_counter() - start
    return out


ALL_CASES = {"all_l1_adam": (1, "adam"), "all_l2_adam_clip": (2, "adam_clip"), "all_l3_adam_clip": (3, "adam_clip")}
ALL_TENSOR_CASES = {"all_tensor_l2_adam": 2, "all_tensor_l3_adam": 3}

CASES = {f"l{level}_{kind}": (level, kind)
         for level in (1, 2, 3) for kind in ("sgd_momentum", "adam", "adam_clip", "lso_sgd", "adam_seq")}


def main() -> None:
    out = _job.out_path()
    chosen = _job.only([*CASES, *ALL_CASES, *ALL_TENSOR_CASES, *OWN_STEP_CASES, "files", "l3_files", "l3_vs_l2",
                         "l3_shared_call", "l3_deferred", "l3_mixed", "l3_backup_resume", "errors"])
    result = {"ranks": tnt.get_size(), "cases": {n: _job.timed(n, lambda n=n: case(*CASES[n])) for n in chosen if n in CASES}}
    for name in chosen:
        if name in ALL_CASES:
            result.setdefault("all", {})[name] = all_case(*ALL_CASES[name], out.parent)
        if name in ALL_TENSOR_CASES:
            result.setdefault("all_tensor", {})[name] = all_tensor_case(ALL_TENSOR_CASES[name], out.parent)
    for name in chosen:
        if name in OWN_STEP_CASES:
            result.setdefault("own_step", {})[name] = _job.timed(name, lambda n=name: own_step_case(*OWN_STEP_CASES[n]))
    if "files" in chosen:
        result["files"] = files_case(out.parent)
    if "l3_files" in chosen:
        result["l3_files"] = _job.timed("l3_files", lambda: l3_files_case(out.parent, _job.shared_dir() or out.parent))
    if "l3_vs_l2" in chosen:
        result["l3_vs_l2"] = l3_vs_l2_case()
    if "l3_shared_call" in chosen:
        result["l3_shared_call"] = _job.timed("l3_shared_call", l3_shared_call_case)
    if "l3_deferred" in chosen:
        result["l3_deferred"] = _job.timed("l3_deferred", l3_deferred_case)
    for name, run in (("l3_mixed", l3_mixed_case),
                      ("l3_backup_resume", lambda: l3_backup_resume_case(_job.shared_dir() or out.parent))):
        if name in chosen:
            result[name] = _job.timed(name, run)
    if "errors" in chosen:
        result["errors"] = error_cases()
    _job.write(out, result)


if __name__ == "__main__":
    main()
