"""Pipelining without running it: plans, boundaries, stage models, schedules, errors.

Single process: these are pure functions of the model (every rank computes the same).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tarantella as tnt
from tarantella.pipelining import (
    PipelineError,
    actions,
    build_stage,
    compute_order,
    micro_batch_sizes,
    peak_in_flight,
    pipeline_idle_fractions,
    plan,
)

SplitLayer = tnt.keras.layers.SplitLayer


def mlp(widths=(16, 16, 12, 3), name="mlp") -> keras.Model:
    keras.utils.set_random_seed(1)
    layers = [keras.Input((10,))]
    layers += [keras.layers.Dense(w, activation="tanh", name=f"d{k}") for k, w in enumerate(widths)]
    return keras.Sequential(layers, name=name)


def skip_model(markers: bool = True) -> keras.Model:
    """Two inputs; x0 (stage 0) is used again on stage 2: a skip over a whole stage."""
    keras.utils.set_random_seed(2)
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    x0 = keras.layers.Dense(8, activation="relu", name="d0")(a)
    x = SplitLayer(name="cut0")(x0) if markers else x0
    x1 = keras.layers.Dense(8, activation="relu", name="d1")(x)
    x = SplitLayer(name="cut1")(x1) if markers else x1
    c = keras.layers.Concatenate(name="cat")([x, x0, keras.layers.Dense(4, name="db")(b)])
    out = keras.layers.Dense(3, activation="softmax", name="out")(c)
    return keras.Model([a, b], out, name="skip")


# -- plans -----------------------------------------------------------------------------------
def test_markers_give_stages_and_skip_boundary_goes_to_every_consumer():
    p = plan(skip_model())
    assert p.num_stages == 3 and p.source == "markers"
    assert [st.layer_names for st in p.stages] == [("d0",), ("d1",), ("db", "cat", "out")]
    by_tensor = {b.tensor: b for b in p.boundaries}
    assert by_tensor["d0:0:0"].producer == 0 and by_tensor["d0:0:0"].consumers == (1, 2)
    assert by_tensor["d1:0:0"].producer == 1 and by_tensor["d1:0:0"].consumers == (2,)
    assert len(p.boundaries) == 2
    # The second input is read by the stage that uses it, not sent through the pipeline.
    assert p.stages[0].data_inputs == (0,) and p.stages[2].data_inputs == (1,)


def test_auto_partition_balances_training_bytes_over_contiguous_stages():
    model = mlp(widths=(64, 64, 64, 64, 3))
    p = plan(model, 2)
    assert p.source == "auto" and p.num_stages == 2
    costs = [st.training_bytes() for st in p.stages]
    # Parameters: d0 704, d1-d3 4160 each, d4 195. Cutting after d1 gives 4864 / 8515,
    # after d2 9024 / 4355: the smaller largest stage is the cut after d1.
    assert p.split_after == ["d1"], p.summary(print_fn=None)
    # weights + grads + 2 Adam slots = 4 x weight bytes for trainable weights
    assert costs == [4 * 4 * 4864, 4 * 4 * 8515]


def test_auto_partition_is_optimal_for_the_largest_stage():
    model = mlp(widths=(40, 8, 40, 8, 40, 3))
    for p_ in (2, 3, 4):
        p = plan(model, p_)
        costs = [0] + [sum(int(np.prod(v.shape)) * 16 for v in layer.weights) for layer in model.layers]
        n = len(model.layers)
        best = min(  # brute force over all contiguous cuts
            max(sum(costs[1:][a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
            for cuts in _combinations(n, p_ - 1)
        )
        assert max(st.training_bytes() for st in p.stages) == best


def _combinations(n, k):
    import itertools

    return [c for c in itertools.combinations(range(1, n), k)]


def test_plan_can_be_edited_by_layer_name_and_summarised():
    p = plan(mlp(), 2).with_split_after(["d0", "d2"])
    assert p.num_stages == 3 and p.split_after == ["d0", "d2"] and p.source == "split_after"
    text = p.summary(print_fn=None)
    assert "stage 2" in text and "receives d2:0:0 (12,) float32 from stage 1" in text
    assert plan(mlp(), split_after=["d1"]).stage_of_layer("d2") == 1


def test_stage_models_hold_only_their_layers_and_reproduce_the_serial_forward():
    model = skip_model()
    p = plan(model)
    stages = [build_stage(p, s) for s in range(p.num_stages)]
    names = [sorted(layer.name for layer in st.model.layers if not isinstance(layer, keras.layers.InputLayer))
             for st in stages]
    assert names == [["d0"], ["d1"], ["cat", "db", "out"]]
    assert [len(st.model.weights) for st in stages] == [2, 2, 4]  # no stage holds the whole model
    assert sum(len(st.model.weights) for st in stages) == len(model.weights)
    rng = np.random.default_rng(0)
    a, b = (keras.ops.convert_to_tensor(rng.normal(size=s).astype("float32")) for s in ((5, 6), (5, 4)))
    (x0,) = keras.tree.flatten(stages[0].model([a]))  # the boundaries a stage sends
    (x1,) = keras.tree.flatten(stages[1].model([x0]))
    out = stages[2].model([b, x0, x1])  # inputs: data (b), then boundaries by index (d0, d1)
    assert stages[2].inputs == (0, 1)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(model([a, b])))


def test_stage_layers_are_clones_not_the_users_layers():
    model = mlp()
    st = build_stage(plan(model, 2), 0)
    assert all(layer is not model.get_layer(layer.name) for layer in st.model.layers
               if not isinstance(layer, keras.layers.InputLayer))


def test_split_layer_is_a_serialisable_identity():
    model = skip_model()
    clone = keras.Model.from_config(model.get_config())
    assert sum(isinstance(layer, SplitLayer) for layer in clone.layers) == 2
    x = np.arange(12, dtype="float32").reshape(3, 4)
    np.testing.assert_array_equal(np.asarray(SplitLayer()(x)), x)


# -- errors ----------------------------------------------------------------------------------------
def test_layer_used_in_two_stages_is_tied_master_first_replica_after():
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    x = SplitLayer()(shared(inp))
    out = shared(keras.layers.Dense(4)(x))
    p = plan(keras.Model(inp, out))
    assert [(t.layer, t.stages) for t in p.ties] == [("shared", (0, 1))]
    assert "shared" in p.stages[0].layer_names and p.stages[1].replicas == ("shared",)
    assert "replicas of tied layers: shared" in p.summary(print_fn=None)
    stage1 = build_stage(p, 1).model
    assert [v.path for v in stage1.trainable_weights if v.path.startswith("shared")] == \
        ["shared/kernel", "shared/bias"]


def test_layer_with_moving_statistics_on_two_stages_is_refused_by_name():
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    norm = keras.layers.BatchNormalization(name="norm")
    x = SplitLayer()(norm(inp))
    out = norm(keras.layers.Dense(4)(x))
    with pytest.raises(PipelineError, match="layer 'norm' is called in stages 0 and 1 and holds non-trainable"):
        plan(keras.Model(inp, out))


def nested_model(marker: bool = False) -> keras.Model:
    """A backbone model nested in a task model, with keras op nodes (x[:, 0], ops.mean,
    ops.transpose) and a dynamic sequence axis."""
    keras.utils.set_random_seed(4)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(10, 8, name="emb")(tokens)
    for k in range(3):
        h = keras.layers.Dense(8, activation="tanh", name=f"inner{k}")(h)
        if marker and k == 1:
            h = SplitLayer(name="cut")(h)
    backbone = keras.Model(tokens, {"seq": h, "first": h[:, 0, :]}, name="backbone")
    ids = keras.Input((None,), dtype="int32", name="ids")
    out = backbone(ids)
    x = keras.ops.mean(out["seq"], axis=1) + out["first"]
    x = keras.layers.Reshape((2, 4))(x)
    x = keras.layers.Flatten()(keras.ops.transpose(x, (0, 2, 1)))
    return keras.Model(ids, keras.layers.Dense(3, name="head")(x), name="task")


def test_nested_models_are_flattened_and_the_partition_cuts_through_them():
    p = plan(nested_model(), 2)
    names = [c.layer.name for c in p.graph.calls]
    assert "backbone" not in names and {"emb", "inner0", "inner2", "head"} <= set(names)
    assert any(n.startswith("get_item") for n in names)  # x[:, 0, :], an op node
    inner = {s for c in p.graph.calls if c.layer.name.startswith("inner") for s in [p.stage_of_call[c.index]]}
    assert inner == {0, 1}  # the cut falls inside the backbone
    assert p.graph.layer_order == ["emb", "inner0", "inner1", "inner2", "head"]
    assert all(b.tensor.startswith("backbone/") for b in p.boundaries)


def test_dynamic_boundary_shapes_follow_each_steps_inputs():
    from tarantella.pipelining._shapes import BoundaryShapes

    p = plan(nested_model(marker=True))
    assert p.boundaries[0].shape == (None, 8)
    shapes = BoundaryShapes(p)
    assert shapes.shapes([(5, 7)]) == [(7, 8)] and shapes.shapes([(2, 3)]) == [(3, 8)]


def test_auto_partition_never_splits_a_shared_layer():
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    x = shared(keras.layers.Dense(4, name="first")(inp))
    x = shared(keras.layers.Dense(4, name="middle")(x))
    out = keras.layers.Dense(2, name="last")(x)
    p = plan(keras.Model(inp, out), 2)
    assert len({p.stage_of_call[c.index] for c in p.graph.calls if c.layer.name == "shared"}) == 1


def test_subclassed_model_is_refused_with_the_fix():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    model = Sub()
    model(np.zeros((1, 3), "float32"))
    with pytest.raises(PipelineError, match=r"subclassed model.*functional API"):
        plan(model, 2)


def test_markers_disagreeing_with_num_pipeline_stages():
    with pytest.raises(PipelineError, match="cut it into 3 stages, but num_pipeline_stages=2"):
        plan(skip_model(), 2)


def test_no_markers_and_no_stage_count():
    with pytest.raises(PipelineError, match="pass num_pipeline_stages=p"):
        plan(mlp())


def test_more_stages_than_layers_and_bad_split_points():
    with pytest.raises(PipelineError, match="only 4 layer calls"):
        plan(mlp(), 5)
    with pytest.raises(PipelineError, match="no layer of model"):
        plan(mlp(), split_after=["nope"])
    with pytest.raises(PipelineError, match="not in execution order"):
        plan(mlp(), split_after=["d2", "d0"])
    with pytest.raises(PipelineError, match="positive integer"):
        plan(mlp(), 0)


def test_unbuilt_sequential_is_refused():
    with pytest.raises(PipelineError, match="not built"):
        plan(keras.Sequential([keras.layers.Dense(2), keras.layers.Dense(2)]), 2)


def test_model_options_are_checked_on_one_rank_too():
    model = mlp()
    with pytest.raises(PipelineError, match="num_micro_batches must be an integer >= 1"):
        tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_pipeline_stages=2,
                  num_micro_batches=0)
    with pytest.raises(PipelineError, match="pipeline_schedule='zigzag' is unknown"):
        tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_pipeline_stages=2,
                  pipeline_schedule="zigzag")
    with pytest.raises(PipelineError, match=r"only apply to ParallelStrategy\.PIPELINING"):
        tnt.Model(model, num_micro_batches=4)
    # One rank: the data-parallel path runs the model (markers are identities).
    assert isinstance(tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                                num_pipeline_stages=2), tnt.Model)


def test_layout_rules():
    from tarantella._core.mesh import check_layout

    check_layout("pipelining", 3, num_pipeline_stages=3)
    check_layout("all", 4, num_pipeline_stages=2)
    with pytest.raises(PipelineError, match="Launch with `tarantella -n 2`"):
        check_layout("pipelining", 4, num_pipeline_stages=2)
    with pytest.raises(PipelineError, match="not a multiple of num_pipeline_stages=2"):
        check_layout("all", 3, num_pipeline_stages=2)


# -- schedules -------------------------------------------------------------------------------------------
def _order(schedule, p, m, s):
    return " ".join(str(a) for a in compute_order(schedule, p, m, s))


def test_gpipe_and_1f1b_orders():
    assert _order("gpipe", 2, 3, 0) == "F0 F1 F2 B0 B1 B2"
    assert _order("1f1b", 3, 4, 0) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert _order("1f1b", 3, 4, 1) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert _order("1f1b", 3, 4, 2) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert _order("1f1b", 4, 2, 0) == "F0 F1 B0 B1"
    assert _order("gpipe", 3, 2, 1) == _order("gpipe", 3, 2, 1)  # deterministic
    assert " ".join(str(a) for a in compute_order("1f1b", 3, 3, 1, training=False)) == "F0 F1 F2"


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_1f1b_holds_at_most_min_p_minus_s_m(p, m):
    for s in range(p):
        order = compute_order("1f1b", p, m, s)
        assert peak_in_flight(order) == min(p - s, m)
        assert peak_in_flight(compute_order("gpipe", p, m, s)) == m
        backwards = [a.micro_batch for a in order if a.kind == "B"]
        assert backwards == list(range(m))  # gradients accumulate in micro-batch order
        assert sorted(a.micro_batch for a in order if a.kind == "F") == list(range(m))


def test_actions_receive_before_and_send_after_with_skip_connections():
    p = plan(skip_model())
    acts = [str(a) for a in actions(p, "gpipe", 1, 0)]
    assert acts == ["F0", "SEND_ACT(mb=0, b=0, stage=1)", "SEND_ACT(mb=0, b=0, stage=2)",
                    "RECV_GRAD(mb=0, b=0, stage=1)", "RECV_GRAD(mb=0, b=0, stage=2)", "B0"]
    acts = [str(a) for a in actions(p, "1f1b", 1, 2)]
    assert acts == ["RECV_ACT(mb=0, b=0, stage=0)", "RECV_ACT(mb=0, b=1, stage=1)", "F0", "B0",
                    "SEND_GRAD(mb=0, b=0, stage=0)", "SEND_GRAD(mb=0, b=1, stage=1)"]


def test_micro_batch_sizes_differ_by_at_most_one_and_drop_nothing():
    assert micro_batch_sizes(10, 4) == [3, 3, 2, 2]
    assert micro_batch_sizes(3, 4) == [1, 1, 1]
    assert micro_batch_sizes(0, 4) == []
    for b in range(0, 40):
        for m in range(1, 9):
            sizes = micro_batch_sizes(b, m)
            assert sum(sizes) == b and (not sizes or max(sizes) - min(sizes) <= 1) and 0 not in sizes
    with pytest.raises(PipelineError, match=">= 1"):
        micro_batch_sizes(4, 0)


def test_idle_fractions_count_each_step_from_the_first_stage_in_to_the_last_out():
    # Step 1 spans 0..10 s (stage 1 enters late, stage 0 leaves last), step 2 spans 20..28 s:
    # 18 s of pipeline; stage 0 computed 6 + 6 s, stage 1 7 + 2 s. On its own clock stage 1
    # would look idle 1 - 9/13 only; over the spans it is idle 1 - 9/18.
    stage0 = {"windows": [(0.0, 10.0, 6.0), (20.0, 28.0, 6.0)]}
    stage1 = {"windows": [(1.0, 9.0, 7.0), (21.0, 26.0, 2.0)]}
    assert pipeline_idle_fractions([stage0, stage1]) == pytest.approx([1 - 12 / 18, 1 - 9 / 18])
    with pytest.raises(ValueError, match="different numbers of steps"):
        pipeline_idle_fractions([stage0, {"windows": stage1["windows"][:1]}])


def test_float16_read_variables_are_those_mixed_float16_layers_autocast():
    """The loss-scale skip checks these gradients in float16 (serial Keras computes them in
    float16; the pipeline sums micro-batches in float32): a float32 layer's are not."""
    from tarantella.pipelining._stage_runtime import float16_read_variables

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        inp = keras.Input((4,))
        x = keras.layers.Dense(3, name="half")(inp)
        x = keras.layers.Dense(2, dtype="float32", name="full")(x)
        model = keras.Model(inp, x)
    finally:
        keras.config.set_dtype_policy(previous)
    assert [v.path for v in model.trainable_variables] == ["half/kernel", "half/bias", "full/kernel", "full/bias"]
    assert float16_read_variables(model) == [True, True, False, False]
