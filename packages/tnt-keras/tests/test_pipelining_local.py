"""Pipelined steps in one process (stages as threads) against serial Keras.

The stages run the same executor, schedules and end-of-step code as on p ranks (only
the messages go through in-process queues), so these tests pin down the arithmetic:
loss weighting b_i / B, gradient accumulation order, regularisation once per step,
global_clipnorm over all stages, metrics, evaluate and predict. Launched runs
(test_pipelining_jobs.py) check the same on real ranks.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tarantella as tnt
from tarantella.pipelining import LocalPipeline, PipelineError

tf.config.experimental.enable_op_determinism()

SplitLayer = tnt.keras.layers.SplitLayer
LOSS = "sparse_categorical_crossentropy"
N, B = 50, 23  # batches of 23, 23, 4: B % m != 0 and a last batch smaller than m = 6


def mlp() -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((10,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(12, activation="tanh"),
        keras.layers.Dense(3, activation="softmax"),
    ], name="mlp")


def skip_model() -> keras.Model:
    """Two inputs; stage 0's output is used on stages 1 and 2; an L2 loss on stage 0."""
    keras.utils.set_random_seed(2)
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    x0 = keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.05))(a)
    x1 = keras.layers.Dense(8, activation="relu")(SplitLayer()(x0))
    x = keras.layers.Concatenate()([SplitLayer()(x1), x0, keras.layers.Dense(4)(b)])
    return keras.Model([a, b], keras.layers.Dense(3, activation="softmax")(x), name="skip")


def data(two_inputs: bool):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, N).astype("int32")
    if two_inputs:
        x = (rng.normal(size=(N, 6)).astype("float32") + y[:, None] * 0.3,
             rng.normal(size=(N, 4)).astype("float32"))
    else:
        x = rng.normal(size=(N, 10)).astype("float32") + y[:, None] * 0.3
    return x, y


def batches(x, y):
    for lo in range(0, N, B):
        xs = tuple(tf.constant(a[lo:lo + B]) for a in x) if isinstance(x, tuple) else tf.constant(x[lo:lo + B])
        yield xs, tf.constant(y[lo:lo + B])


def serial(make, optimizer, x, y, epochs=2):
    model = make()
    model.compile(optimizer, LOSS, metrics=["accuracy"])
    history = model.fit(list(x) if isinstance(x, tuple) else x, y, batch_size=B, epochs=epochs,
                        shuffle=False, verbose=0).history
    return model, history


def pipelined(make, optimizer, x, y, *, p=None, m=6, schedule="1f1b", epochs=2):
    pipe = LocalPipeline(make(), p, num_micro_batches=m, pipeline_schedule=schedule)
    pipe.compile(optimizer, LOSS, metrics=["accuracy"])
    history: dict[str, list] = {}
    for _ in range(epochs):
        pipe.reset_metrics()
        for xb, yb in batches(x, y):
            logs = pipe.train_step(xb, yb)
        for k, v in logs.items():
            history.setdefault(k, []).append(v)
    return pipe, history


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64)))) for u, v in zip(a, b))


CASES = {
    "mlp_p3_auto_adam": (mlp, lambda: keras.optimizers.Adam(0.01), 3),
    "mlp_p2_auto_sgd_momentum": (mlp, lambda: keras.optimizers.SGD(0.05, momentum=0.9), 2),
    "skip_two_inputs_markers_l2_clipnorm": (skip_model, lambda: keras.optimizers.Adam(0.02, global_clipnorm=0.05), None),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    make, opt, p = CASES[request.param]
    x, y = data(two_inputs=make is skip_model)
    ref, ref_hist = serial(make, opt(), x, y)
    runs = {s: pipelined(make, opt(), x, y, p=p, schedule=s) for s in ("gpipe", "1f1b", "zb-h1")}
    return request.param, x, y, ref, ref_hist, runs


def test_history_and_weights_match_serial(case):
    name, _, _, ref, ref_hist, runs = case
    for schedule, (pipe, hist) in runs.items():
        assert sorted(hist) == sorted(ref_hist)
        hd = max_diff([hist[k] for k in sorted(hist)], [ref_hist[k] for k in sorted(hist)])
        wd = max_diff(pipe.get_weights(), ref.get_weights())
        print(f"{name} {schedule}: history {hd:.1e} weights {wd:.1e}")
        assert hd <= 2e-6, (schedule, hist, ref_hist)
        assert wd <= 5e-6, schedule


def cut_backward(pipe) -> list[bool]:
    """Per stage: whether ZB-H1's W ran as the weight-gradient part only (Note [Split backward])."""
    return [all(c._splitter is not None and c.split_fallback is None for c in st.executor.chunks.values())
            for st in pipe.stages]


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_schedules_are_bitwise_1f1b(case, schedule):
    runs = case[5]
    a, b = runs[schedule][0].get_weights(), runs["1f1b"][0].get_weights()
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert runs[schedule][1] == runs["1f1b"][1]
    if schedule == "zb-h1":
        assert cut_backward(runs[schedule][0]) == [True] * len(runs[schedule][0].stages)


def test_zb_h1_without_the_cut_backward_warns_and_stays_bitwise_1f1b(monkeypatch):
    """A graph the cut refuses (Note [Split backward]): the persistent tape, the same weights."""
    from tarantella.pipelining import _split_backward

    def refuse(self, cf, all_args, watched):
        raise _split_backward.SplitUnavailable("refused by the test")

    x, y = data(two_inputs=False)
    ref, ref_hist = pipelined(mlp, keras.optimizers.Adam(0.01), x, y, p=2, epochs=1)
    monkeypatch.setattr(_split_backward.SplitBackward, "_cut", refuse)
    with pytest.warns(UserWarning, match="refused by the test.*recomputes the backward pass"):
        pipe, hist = pipelined(mlp, keras.optimizers.Adam(0.01), x, y, p=2, schedule="zb-h1", epochs=1)
    assert cut_backward(pipe) == [False, False]
    assert [c.split_fallback for st in pipe.stages for c in st.executor.chunks.values()] == ["refused by the test"] * 2
    assert hist == ref_hist
    assert all(np.array_equal(a, b) for a, b in zip(pipe.get_weights(), ref.get_weights()))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gradients_summed_in_place_train_bitwise_as_the_tapes_sums(monkeypatch, schedule):
    """Note [Gradients summed in place]: W adding each dense gradient into the micro-batch
    sum as it is computed trains bitwise as the tape's whole gradient sets added as tensors
    (the cut refused: the path every schedule but ZB-H1 took before). The skip model: an L2
    loss on stage 0 (its regularisation target), two inputs, clipnorm over all stages."""
    from tarantella.pipelining import _split_backward

    x, y = data(two_inputs=True)

    def opt():
        return keras.optimizers.Adam(0.02, global_clipnorm=0.05)

    pipe, hist = pipelined(skip_model, opt(), x, y, schedule=schedule, epochs=1)
    # in place on every stage: its W variants were built (first micro-batch: set; then: add)
    assert [{k[2] for k in c._splitter._into} for st in pipe.stages for c in st.executor.chunks.values()] \
        == [{False, True}] * len(pipe.stages)

    def refuse(self, cf, all_args, watched):
        raise _split_backward.SplitUnavailable("refused by the test")

    monkeypatch.setattr(_split_backward.SplitBackward, "_cut", refuse)
    ref, ref_hist = pipelined(skip_model, opt(), x, y, schedule=schedule, epochs=1)
    assert cut_backward(ref) == [False] * len(ref.stages)
    assert hist == ref_hist
    assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(pipe.get_weights(), ref.get_weights()))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_no_micro_batch_gradient_set_beside_the_sums(monkeypatch, schedule):
    """Issue 29: a stage never holds a micro-batch's whole gradient set beside the sum. Every
    micro-batch summed in order hands the accumulator, at each dense position, the sum's own
    variable (its gradient was written or added inside W), not a gradient tensor; and the
    in-place W functions return no tensor of a weight's shape.
    Fails on the tape's path (each backward returned all its gradients as tensors)."""
    from tarantella.pipelining import _executor

    calls: list[tuple[int, bool]] = []  # (micro-batch, every dense position is the sum's variable)
    add = _executor._Accumulator.add

    def checked(self, i, grads):
        if i == self.next:
            sums = self.grads
            calls.append((i, all(isinstance(g, tf.Variable) and (sums is None or g is sums[k])
                                 for k, g in enumerate(grads))))
        return add(self, i, grads)

    monkeypatch.setattr(_executor._Accumulator, "add", checked)
    x, y = data(two_inputs=False)
    pipe, _ = pipelined(mlp, keras.optimizers.Adam(0.01), x, y, p=2, schedule=schedule, epochs=1)
    assert {i for i, _ in calls} == set(range(6)), calls  # m = 6 micro-batches summed in order
    assert all(in_place for _, in_place in calls), calls
    for st in pipe.stages:
        for c in st.executor.chunks.values():
            weights = {tuple(v.shape) for v in c.model.trainable_variables}
            fns = [held[1] for held in c._splitter._into.values()]
            assert fns
            # (stage 0's W also returns the data input's unused gradient: rows x 10)
            returned = {tuple(o.shape) for fn in fns for o in fn.graph.outputs}
            assert not returned & weights, (returned, weights)


def test_1f1b_holds_fewer_micro_batches_than_gpipe(case):
    runs = case[5]
    p = len(runs["1f1b"][0].stages)
    assert [st.peak_live for st in runs["1f1b"][0].stages] == [min(p - s, 6) for s in range(p)]
    assert [st.peak_live for st in runs["gpipe"][0].stages] == [6] * p


def test_evaluate_and_predict_match_serial(case):
    _, x, y, ref, _, runs = case
    pipe = runs["1f1b"][0]
    xs = list(x) if isinstance(x, tuple) else x
    ref_eval = ref.evaluate(xs, y, batch_size=B, verbose=0, return_dict=True)
    pipe.reset_metrics()
    for xb, yb in batches(x, y):
        logs = pipe.test_step(xb, yb)
    assert sorted(logs) == sorted(ref_eval)
    assert max_diff([logs[k] for k in sorted(logs)], [ref_eval[k] for k in sorted(logs)]) <= 2e-6
    preds = np.concatenate([np.asarray(pipe.predict_step(xb)) for xb, _ in batches(x, y)])
    np.testing.assert_allclose(preds, ref.predict(xs, batch_size=B, verbose=0), atol=2e-6)


def test_stages_hold_only_their_variables(case):
    _, _, _, ref, _, runs = case
    pipe = runs["1f1b"][0]
    counts = [len(st.model.trainable_weights) for st in pipe.stages]
    assert sum(counts) == len(ref.trainable_weights) and max(counts) < len(ref.trainable_weights)


def test_a_stage_that_never_sends_ends_with_an_error_not_a_hang():
    pipe = LocalPipeline(mlp(), 2, num_micro_batches=2, timeout=2.0)
    pipe.compile("sgd", LOSS)
    pipe.stages[0].executor.transport.isend = lambda *a, **k: None  # stage 0 loses its messages
    x, y = data(False)
    with pytest.raises(PipelineError, match=r"stage [01] waited 2s for message \(1, 0, [01]\) from stage [01], which never sent it"):
        pipe.train_step(tf.constant(x[:8]), tf.constant(y[:8]))


def test_a_deferred_model_trains_bitwise_as_the_built_one_and_stays_deferred():
    """deferred_variables: the user's model holds no values; each stage takes its initial
    values from the initializers, which give what an eagerly built model holds."""
    x, y = data(False)
    with tnt.pipelining.deferred_variables():
        lazy = mlp()
    assert all(v._value is None for v in lazy.weights)
    built, _ = pipelined(mlp, keras.optimizers.Adam(0.01), x, y, p=2)
    pipe = LocalPipeline(lazy, 2, num_micro_batches=6)
    pipe.compile(keras.optimizers.Adam(0.01), LOSS, metrics=["accuracy"])
    for _ in range(2):
        for xb, yb in batches(x, y):
            pipe.train_step(xb, yb)
    assert all(np.array_equal(u, v) for u, v in zip(pipe.get_weights(), built.get_weights()))
    assert all(v._value is None for v in lazy.weights)  # never materialised


def test_a_deferred_model_on_one_rank_is_materialised_and_trains_as_serial():
    x, y = data(False)
    ref, ref_hist = serial(mlp, keras.optimizers.Adam(0.01), x, y)
    with tnt.pipelining.deferred_variables():
        lazy = mlp()
    model = tnt.Model(lazy, parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_pipeline_stages=2)
    model.compile(keras.optimizers.Adam(0.01), LOSS, metrics=["accuracy"])
    hist = model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    assert max_diff([hist[k] for k in sorted(hist)], [ref_hist[k] for k in sorted(hist)]) <= 2e-6
    assert max_diff(model.get_weights(), ref.get_weights()) <= 5e-6


def tied_nested_model() -> keras.Model:
    """What real models bring (issue 27): a backbone model nested in the task model with a
    stage cut inside it (SplitLayer), a dynamic sequence axis crossing the cut, keras op
    nodes (x[:, 0], ops.mean), a layer called on both stages (tied), and a layer whose
    output reaches no model output (its weights get no gradient)."""
    keras.utils.set_random_seed(6)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    tied = keras.layers.Dense(8, activation="tanh", name="tied")
    h = tied(keras.layers.Embedding(10, 8, name="emb")(tokens))
    h = SplitLayer(name="cut")(keras.layers.Dense(8, activation="relu", name="inner")(h))
    h = keras.layers.Dense(8, name="after_cut")(h)
    pooled = keras.layers.Dense(4, name="unused_pooler")(h[:, 0, :])
    backbone = keras.Model(tokens, {"seq": h, "pooled": pooled}, name="backbone")
    ids = keras.Input((None,), dtype="int32", name="ids")
    x = tied(keras.ops.mean(backbone(ids)["seq"], axis=1))
    return keras.Model(ids, keras.layers.Dense(3, activation="softmax", name="head")(x), name="task")


@pytest.mark.filterwarnings("ignore:Gradients do not exist")  # serial Keras on unused_pooler
def test_nested_tied_op_nodes_dynamic_axis_and_unused_layers_train_as_serial():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 10, size=(N, 5)).astype("int32")
    y = (x[:, 0] % 3).astype("int32")
    ref, ref_hist = serial(tied_nested_model, keras.optimizers.Adam(0.01), x, y)
    pipe, hist = pipelined(tied_nested_model, keras.optimizers.Adam(0.01), x, y, m=4)
    zb, zb_hist = pipelined(tied_nested_model, keras.optimizers.Adam(0.01), x, y, m=4, schedule="zb-h1")
    # ZB-H1's cut backward: sparse (Embedding), tied and unused weights bitwise as 1F1B's
    assert cut_backward(zb) == [True, True] and zb_hist == hist
    assert all(np.array_equal(a, b) for a, b in zip(zb.get_weights(), pipe.get_weights()))
    assert [(t.layer, t.stages) for t in pipe.plan.ties] == [("tied", (0, 1))]
    assert pipe.plan.boundaries[0].shape == (None, 8)  # the sequence axis is dynamic
    assert sorted(hist) == sorted(ref_hist)
    hd = max_diff([hist[k] for k in sorted(hist)], [ref_hist[k] for k in sorted(hist)])
    wd = max_diff(pipe.get_weights(), ref.get_weights())
    assert len(pipe.get_weights()) == len(ref.get_weights())  # the tied layer once
    print(f"nested/tied/dynamic: history {hd:.1e} weights {wd:.1e}")
    assert hd <= 2e-6 and wd <= 5e-6
    copies = [[w.numpy() for w in st.model.trainable_weights if w.path.startswith("tied/")]
              for st in pipe.stages]
    assert all(np.array_equal(a, b) for a, b in zip(*copies))  # master and replica never drift
    unused = pipe.stages[0].model.tnt_unused_layers + pipe.stages[1].model.tnt_unused_layers
    assert [layer.name for layer in unused] == ["unused_pooler"]
    predicted = pipe.predict_step(tf.constant(x[:9]))
    np.testing.assert_allclose(np.asarray(predicted), ref.predict(x[:9], verbose=0), atol=5e-6)
