"""tnt.plan_parallel and ParallelStrategy.AUTO (issue 31, docs/auto.md).

On one process: a budget that only sharded DATA meets picks sharding; one that only a
pipeline meets picks the pipeline; an impossible budget is a MemoryBudgetError naming the
smallest feasible budget (and that budget then plans); the summary lists rejections with
how far over budget; the DATA prediction's categories match the weights counted here.
Launched (jobs/auto.py, 2 ranks): AUTO under a budget below plain DATA's picks a
memory-saving layout, the same on both ranks, and trains as serial Keras does; under a
budget only level 3 meets it keeps a deferred model deferred and trains as serial Keras.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import share

import tarantella as tnt
from tarantella.auto import LayerCost, Profile
from tarantella.auto._partition import time_split_after
from tarantella.auto._profile import profile

TOL_LOSS, TOL_WEIGHTS = 1e-5, 2e-5  # float32 summation order, as tests/test_exactness.py


def one_conv() -> keras.Model:
    """One layer: no pipeline cut, nothing a tensor group splits; DATA levels only."""
    inp = keras.Input((4, 4, 64))
    return keras.Model(inp, keras.layers.Conv2D(64, 3, padding="same", name="conv")(inp))


def two_convs() -> keras.Model:
    """Two equal convolutions and a small head: a 2-stage pipeline halves the weights."""
    inp = keras.Input((4, 4, 64))
    x = keras.layers.Conv2D(64, 3, padding="same", name="c1")(inp)
    x = keras.layers.Conv2D(64, 3, padding="same", name="c2")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inp, keras.layers.Dense(4, name="head")(x))


def weight_bytes(model) -> int:
    return 4 * model.count_params()  # float32


def given_profile(model: keras.Model, seconds_per_row: dict[str, float]) -> Profile:
    """The profile of ``model``'s layers (float32 bytes from the layers) with the given times."""
    return Profile(model.name, [LayerCost(layer.name, 4 * layer.count_params(), 4 * layer.count_params(),
                                          4 * int(np.prod(layer.output.shape[1:])), 0.0,
                                          seconds_per_row[layer.name], True)
                                for layer in model.layers[1:]], (8,))


def test_the_update_is_priced_per_variable_and_byte_on_the_ranks_that_run_it():
    # Note [The update's time]: each rank's step adds the optimizer update of what it updates.
    # two_convs: c1 and c2 hold a 3 x 3 x 64 x 64 kernel and 64 biases each (2 variables,
    # 147712 bytes), the head 64 x 4 + 4 (2 variables, 1040 bytes), the pool none.
    import dataclasses

    m = two_convs()
    base = given_profile(m, {"c1": 1e-4, "c2": 1e-4, "pool": 0.0, "head": 0.0})
    counts = {"c1": 2, "c2": 2, "pool": 0, "head": 2}
    layers = [dataclasses.replace(c, trainable_variables=counts[c.name]) for c in base.layers]
    prof = dataclasses.replace(base, layers=layers, update_s_per_variable=1e-3, update_s_per_byte=1e-8)
    free = dataclasses.replace(prof, update_s_per_variable=0.0, update_s_per_byte=0.0)

    def compute(p) -> dict[str, float]:
        plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=None, profile_=p)
        return {c.layout.describe(): c.estimate.compute_s for c in plan.feasible}

    priced, unpriced = compute(prof), compute(free)
    whole = 6 * 1e-3 + (2 * 147712 + 1040) * 1e-8  # every variable, on every DATA replica
    assert priced["DATA(d=2)"] - unpriced["DATA(d=2)"] == pytest.approx(whole, rel=1e-9)
    for level in (1, 2):  # the owners' half
        name = f"DATA(d=2, sharding={level})"
        assert priced[name] - unpriced[name] == pytest.approx(whole / 2, rel=1e-9), name
    # A 2-stage pipeline cut after c1: the stages update side by side; the slower one (c2 + head:
    # 4 variables, 148752 bytes) is the step's.
    piped = [n for n in priced if n.startswith("PIPELINING(d=1, p=2")]
    assert piped, sorted(priced)
    for name in piped:
        assert priced[name] - unpriced[name] == pytest.approx(4e-3 + 148752e-8, rel=1e-9), name
    # Where the pipeline executor's cost per variable was measured (Note [The pipeline's own
    # cost]: it includes the update's launches), it replaces the update's per-variable price.
    executor = dataclasses.replace(prof, pipeline_variable_s=5e-4)
    for name, seconds in compute(executor).items():
        expected = priced[name] + (4 * 5e-4 - 4e-3 if name in piped else 0.0)
        assert seconds == pytest.approx(expected, rel=1e-9), name


def test_budget_between_sharded_and_plain_data_picks_sharding():
    m = one_conv()
    w = weight_bytes(m)
    # Adam, d = 2: DATA holds 4 w (weights, gradients, 2 slots; its transient buckets carry
    # the gradients) + the update's temporaries (2 copies of the one layer: 2 w) + activations;
    # sharding halves the slots: 5 w + activations.
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=int(5.5 * w))
    assert plan.layout.strategy is tnt.ParallelStrategy.DATA and plan.layout.sharding in (1, 2), plan.summary()
    assert plan.choice.estimate.total_bytes <= int(5.5 * w)
    assert plan.choice.estimate.memory["update_temporaries"] == 2 * w, plan.choice.estimate.memory
    reasons = {c.layout.describe(): c.rejected for c in plan.rejected}
    assert reasons["DATA(d=2)"].startswith("over budget by"), reasons
    assert "pipeline" in reasons["PIPELINING(d=1, p=2 m=2)"], reasons
    assert "nothing splits" in reasons["TENSOR(d=1, t=2)"], reasons


def sixteen_convs() -> keras.Model:
    """Sixteen equal convolutions on a 2 x 2 map between two calls of one frozen
    BatchNormalization (``trainable = False``: its four vectors are weights, none trained):
    nothing a tensor group splits, no pipeline cut (every cut puts the shared layer's moving
    statistics on two stages), and level 3 gathers one sixteenth of the weights at a time.
    (Without the shared layer a 2-stage pipeline holds half the state, 2 w, less than level
    3's 2 w + its gathered copies: the planner rightly takes it.)"""
    inp = keras.Input((2, 2, 64))
    norm = keras.layers.BatchNormalization(name="shared_bn")
    norm.trainable = False  # frozen, as in fine-tuning: Keras 3 then runs it in inference mode
    x = norm(inp)
    for i in range(16):
        x = keras.layers.Conv2D(64, 3, padding="same", name=f"c{i}")(x)
    return keras.Model(inp, norm(x))


def test_budget_between_level_3_and_the_rest_picks_sharding_3():
    m = sixteen_convs()
    w = weight_bytes(m)
    layer = 4 * (3 * 3 * 64 * 64 + 64)  # one conv: 3 x 3 x 64 x 64 kernel + 64 bias, float32
    norm = 4 * 4 * 64  # the shared BatchNormalization: gamma, beta, moving mean and variance
    assert w == 16 * layer + norm
    acts = 17 * 2 * 2 * 64 * 4  # every conv's and the norm's output per sample x 1 row (2 / 2 replicas)
    # Counted by hand, Adam, d = 2: largest first onto the least loaded replica gives each
    # replica 8 kernels, then 8 of the 16 biases: it owns 8 kernels + 8 biases; it stores them
    # and the frozen norm's 4 vectors (kept whole), receives their gradient sums and keeps
    # their 2 slots; backprop holds 4 copies of one layer
    # (gathered weights, local weight gradient, the reduce-scatter's copy, the next layer's
    # prefetched weights), and the update's temporaries 2 copies of one layer: about 2.375 w + acts.
    # Level 1 / 2: w + w + w (slots / 2) + 2 layers; no pipeline cut (shared_bn on both stages).
    own = 8 * layer
    level3 = {"parameters": own + norm, "gradients": own, "optimizer_slots": 2 * own, "activations": acts,
              "communication_buffers": 4 * layer, "update_temporaries": 2 * layer}
    budget = int(2.45 * w)
    assert sum(level3.values()) < budget < 2.5 * w
    prof = given_profile(m, {**{f"c{i}": 1e-4 for i in range(16)}, "shared_bn": 0.0})  # untimed: not regathered
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=2, memory_budget=budget, profile_=prof)
    assert plan.layout.describe() == "DATA(d=2, sharding=3)", plan.summary(print_fn=None)
    assert plan.model_options() == (tnt.ParallelStrategy.DATA, {"sharding": 3})
    assert {k: v for k, v in plan.memory_per_rank.items() if v} == level3
    reasons = {c.layout.describe(): c.rejected for c in plan.rejected}
    for name in ("DATA(d=2)", "DATA(d=2, sharding=1)", "DATA(d=2, sharding=2)"):
        assert reasons[name].startswith("over budget by"), reasons
    assert "shared_bn" in reasons["PIPELINING(d=1, p=2 m=2)"], reasons
    text = plan.summary(print_fn=None)
    assert "chosen: DATA(d=2, sharding=3)" in text
    assert re.search(r"DATA\(d=2, sharding=2\)\s+[\d.,]+\s+[\d.,]+\s+rejected: over budget by", text), text
    # its time: one more forward per layer (1/3 of forward + backward) and the collectives
    free = tnt.plan_parallel(m, num_ranks=2, global_batch_size=2, memory_budget=None, profile_=prof)
    by_name = {c.layout.describe(): c.estimate for c in free.feasible}
    assert by_name["DATA(d=2, sharding=3)"].compute_s == pytest.approx(by_name["DATA(d=2)"].compute_s * 4 / 3)
    assert by_name["DATA(d=2, sharding=3)"].comm_s > by_name["DATA(d=2, sharding=2)"].comm_s > 0
    from tarantella.auto._search import layouts

    level3_names = sorted(lay.describe() for lay in layouts(4, 8)[0] if lay.sharding == 3)
    assert level3_names == ["DATA(d=4, sharding=3)"], level3_names  # ALL (replicas of stages or groups) refuses 3


def test_level_3_counts_what_it_keeps_whole_on_every_replica():
    """Embedding tables and regularized weights stay whole at level 3 (level 2's treatment):
    stored and given a gradient on every replica; only their slots follow ownership."""
    from tarantella.data_parallel import level3_layout

    inp = keras.Input((3,), dtype="int32")
    x = keras.layers.Embedding(50, 8, name="emb")(inp)  # 400 elements, whole
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(10, kernel_regularizer="l2", name="reg")(x)  # 24 x 10 + 10, whole
    out = keras.layers.Dense(6, name="d")(x)  # 10 x 6 + 6 per layer
    m = keras.Model(inp, out)
    lay = level3_layout(m, 2)
    # a layer is gathered per call only when none of its variables is regularized: all of
    # "reg" stays whole; "d" alone is gathered
    whole = 4 * (400 + 240 + 10)
    assert lay.whole_trainable_bytes == whole and lay.layer_bytes == {"d": 4 * 66}
    # owners, largest first onto the least loaded: emb (1600 B) r0, reg kernel (960) r1,
    # d kernel (240) r1, reg bias (40) r1, d bias (24) r1
    r0, r1 = lay.replicas
    assert (r0.parameters, r0.gradients, r0.owned_trainable) == (whole, whole, 1600)
    assert (r1.parameters, r1.gradients, r1.owned_trainable) == (whole + 4 * 66, whole + 4 * 66, 960 + 240 + 40 + 24)
    assert r0.gathered == r1.gathered == 4 * 4 * 66  # gathered, gradient, its copy, the next layer


def test_level_3_is_rejected_where_it_cannot_run():
    inp = keras.Input((8,))
    m = keras.Model(inp, keras.layers.Dense(8, use_bias=False, name="only")(inp))  # 1 variable, 2 replicas
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=4, memory_budget=None,
                             profile_=given_profile(m, {"only": 1e-4}))
    reasons = {c.layout.describe(): c.rejected for c in plan.rejected}
    assert reasons["DATA(d=2, sharding=3)"].startswith("no sharding=3:"), reasons
    assert "only 1 trainable variables" in reasons["DATA(d=2, sharding=3)"], reasons
    # levels 1-2 too: each of 2 replicas must own a whole variable; tnt.Model would refuse it
    for level in (1, 2):
        assert reasons[f"DATA(d=2, sharding={level})"] == (
            "no sharding: the model has 1 trainable variable(s) for 2 replicas to own whole ones"), reasons
    assert "DATA(d=2)" not in reasons and plan.layout.sharding == 0, plan.summary()


def test_budget_below_sharding_picks_the_pipeline():
    m = two_convs()
    w = weight_bytes(m)
    # sharded DATA: 3 w + activations (3.11 w) + the update's temporaries (2 copies of a conv,
    # 0.99 w); the pipeline's fuller stage 2.71 w + 0.99 w
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=int(3.9 * w))
    assert plan.layout.strategy is tnt.ParallelStrategy.PIPELINING, plan.summary()
    assert plan.layout.stages == 2 and plan.layout.micro_batches in (2, 4, 8)
    assert plan.layout.split_after == ("c1",)  # the pipeline's own plan, bytes-balanced
    strategy, options = plan.model_options()
    assert strategy is tnt.ParallelStrategy.PIPELINING
    assert options == {"num_pipeline_stages": 2, "num_micro_batches": plan.layout.micro_batches}
    rejected = [c.layout.describe() for c in plan.rejected]
    assert {"DATA(d=2)", "DATA(d=2, sharding=1)", "DATA(d=2, sharding=2)"} <= set(rejected), rejected


def test_replicas_of_stages_and_of_tensor_groups_are_planned_with_sharding_too():
    """ALL's replica axis shards (issue 30) as DATA's does: the planner offers levels 1 and 2
    wherever there are replicas, never without, and builds them with ``sharding=``."""
    from tarantella.auto._layout import Layout
    from tarantella.auto._search import layouts

    names = {lay.describe() for lay in layouts(4, 8)[0]}
    assert {"ALL(d=2, t=2, sharding=1)", "ALL(d=2, t=2, sharding=2)", "ALL(d=2, p=2 m=2, sharding=2)",
            "ALL(d=2, p=2 m=2 remat, sharding=1)", "DATA(d=4, sharding=2)"} <= names, sorted(names)
    assert not [n for n in names if "sharding" in n and "d=1" in n], sorted(names)
    assert Layout(2, 1, 2, sharding=2).model_options() == (
        tnt.ParallelStrategy.ALL, {"tensor_parallel_size": 2, "sharding": 2})
    assert Layout(2, 2, 1, micro_batches=4, sharding=1).model_options() == (
        tnt.ParallelStrategy.ALL, {"num_pipeline_stages": 2, "num_micro_batches": 4, "sharding": 1})
    m = two_convs()
    prof = given_profile(m, {"c1": 1e-3, "c2": 1e-3, "pool": 1e-5, "head": 1e-5})
    plan = tnt.plan_parallel(m, num_ranks=4, global_batch_size=8, memory_budget=None, profile_=prof)
    pipes = {c.layout.describe(): c.estimate.memory for c in plan.feasible if c.layout.stages == 2}
    plain, sharded = pipes["ALL(d=2, p=2 m=2 bytes)"], pipes["ALL(d=2, p=2 m=2 bytes, sharding=1)"]
    assert sharded["optimizer_slots"] * 2 == plain["optimizer_slots"] > 0, (plain, sharded)


def test_an_optimizer_that_cannot_be_sharded_rejects_the_sharded_layouts():
    class OwnSGD(keras.optimizers.SGD):  # not one of Keras' (sharding cannot know its update)
        pass

    m = one_conv()
    m.compile(optimizer=OwnSGD(0.1), loss="mse")
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=None)
    reasons = {c.layout.describe(): c.rejected for c in plan.rejected}
    for level in (1, 2):
        assert reasons[f"DATA(d=2, sharding={level})"].startswith("no sharding:"), reasons
        assert "OwnSGD" in reasons[f"DATA(d=2, sharding={level})"], reasons
    assert plan.layout.describe() == "DATA(d=2)", plan.summary()


def test_budget_that_only_recomputation_meets_picks_remat_stages():
    m = two_convs()
    prof = given_profile(m, {"c1": 1e-3, "c2": 1e-3, "pool": 1e-5, "head": 1e-5})  # not the machine's load
    # a large batch: activations (4 KiB per sample and conv) outweigh the weights
    full = tnt.plan_parallel(m, num_ranks=2, global_batch_size=512, memory_budget=None, profile_=prof)
    pipes = {c.layout.describe(): c.estimate for c in full.feasible if c.layout.stages == 2}
    plain, remat = pipes["PIPELINING(d=1, p=2 m=8 bytes)"], pipes["PIPELINING(d=1, p=2 m=8 bytes remat)"]
    # 1F1B keeps min(p - s, m) = 2 micro-batches' activations on stage 0; remat one
    assert remat.memory["activations"] * 2 == plain.memory["activations"], (plain.memory, remat.memory)
    assert remat.compute_s > plain.compute_s  # one more forward pass per micro-batch
    budget = (plain.total_bytes + remat.total_bytes) // 2
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=512, memory_budget=budget, profile_=prof)
    assert plan.layout.remat and plan.layout.stages == 2, plan.summary()
    strategy, options = plan.model_options()
    assert strategy is tnt.ParallelStrategy.PIPELINING and options["remat"] == "stages", options


def test_prediction_of_data_counts_the_weights_as_counted_here(monkeypatch):
    m = two_convs()
    w = weight_bytes(m)
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=10 * w)
    data = next(c for c in plan.feasible + plan.rejected if c.layout.describe() == "DATA(d=2)")
    mem = data.estimate.memory
    assert mem["parameters"] == w and mem["gradients"] == w
    # DATA's transient buckets (the default) replace the gradients they carry: no set of
    # their own, as the memory report counts it
    assert mem["optimizer_slots"] == 2 * w and mem["communication_buffers"] == 0
    # activations: every layer's output per sample x 4 rows (8 / 2 replicas)
    per_sample = 4 * (4 * 4 * 64 * 2 + 64 + 4)
    assert mem["activations"] == per_sample * 4
    monkeypatch.setenv("TNT_COMM_TRANSIENT_BUCKETS", "0")  # kept between rounds: one gradient set
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=10 * w)
    data = next(c for c in plan.feasible + plan.rejected if c.layout.describe() == "DATA(d=2)")
    assert data.estimate.memory["communication_buffers"] == w


def test_impossible_budget_names_the_smallest_feasible_one():
    m = two_convs()
    with pytest.raises(tnt.MemoryBudgetError, match="smallest feasible budget") as err:
        tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=1000)
    smallest = int(re.search(r"\((\d+) bytes", str(err.value)).group(1))
    assert "raise memory_budget=" in str(err.value)
    assert smallest < 5 * weight_bytes(m)  # less than plain DATA needs
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=smallest)
    assert plan.choice.estimate.total_bytes == smallest
    with pytest.raises(tnt.MemoryBudgetError):
        tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=smallest - 1)


def test_summary_lists_choice_alternatives_and_rejections():
    m = two_convs()
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=int(3.2 * weight_bytes(m)))
    text = plan.summary(print_fn=None)
    assert text.startswith("tnt.plan_parallel: 2 rank(s), global batch 8")
    assert f"chosen: {plan.layout.describe()}" in text
    assert re.search(r"DATA\(d=2\)\s+[\d.,]+\s+[\d.,]+\s+rejected: over budget by [\d.]+ MiB", text), text
    if len(plan.feasible) > 1:
        assert "slower by" in text
    assert plan.samples_per_s == pytest.approx(8 / plan.step_time_s)
    # one column for the step, whatever the layouts' names' lengths (remat rows ran over)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layout"))
    end = lines[header].index("step ms") + len("step ms")
    rows = [line for line in lines[header + 1:] if not line.startswith("note:")]
    assert any("remat" in r for r in rows), text
    assert all((r[end - 1].isdigit() or r[end - 1] == "-") and r[end] == " " for r in rows), text


def test_auto_on_one_rank_and_bad_input():
    m = two_convs()
    model = tnt.Model(m, parallel_strategy=tnt.ParallelStrategy.AUTO, global_batch_size=8)
    assert isinstance(model, tnt.Model) and model._tnt_plan.layout.describe() == "DATA(d=1)"
    with pytest.raises(ValueError, match="global_batch_size="):
        tnt.Model(two_convs(), parallel_strategy=tnt.ParallelStrategy.AUTO)
    with pytest.raises(ValueError, match="global_batch_size must be a positive integer"):
        tnt.plan_parallel(m, num_ranks=2, global_batch_size=0)
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=10 * weight_bytes(m))
    with pytest.raises(ValueError, match="the plan is for 2 rank"):
        tnt.Model(two_convs(), plan=plan)


def test_a_given_network_prices_the_plan_and_a_wrong_one_is_named():
    slow = tnt.auto.Network(alpha_s=1e-3, beta_Bps=1e6, name="given here")
    plan = tnt.plan_parallel(two_convs(), num_ranks=2, global_batch_size=8, network=slow)
    fast = tnt.plan_parallel(two_convs(), num_ranks=2, global_batch_size=8)
    assert plan.network == slow and fast.network == tnt.auto.Network()
    assert any("alpha = 1000 us, beta = 0.00 GB/s, a collective inside a step 20 us (given here)" in n
               for n in plan.notes), plan.notes
    data = next(c for c in plan.feasible if c.layout.describe() == "DATA(d=2)")
    data_fast = next(c for c in fast.feasible if c.layout.describe() == "DATA(d=2)")
    assert data.estimate.step_s > data_fast.estimate.step_s  # the slow network's allreduce costs more
    model = tnt.Model(two_convs(), parallel_strategy=tnt.ParallelStrategy.AUTO, global_batch_size=8, network=slow)
    assert model._tnt_plan.network == slow
    with pytest.raises(tnt.auto.AutoError, match=r"network=.*tnt\.auto\.Network"):
        tnt.Model(two_convs(), parallel_strategy=tnt.ParallelStrategy.AUTO, global_batch_size=8, network=(1, 2))
    assert tnt.auto.measure_network().name.startswith("one rank")  # nothing to time on one process


def test_each_collective_inside_a_step_pays_its_own_cost_where_the_step_makes_it():
    """Note [A collective inside a step] (auto/_comm.py): a tensor pair's allreduces, sharding's
    bucketed gathers and level 3's per-layer collectives each add ``Network.collective_s``;
    DATA's fused allreduce (the engine's, outside the step's ops) does not."""
    from tarantella.auto import _comm

    net = tnt.auto.Network(alpha_s=1e-5, beta_Bps=1e9, collective_s=1e-4)
    # 4 allreduces of 1000 bytes each over 2 ranks: 4 x (2 alpha + 1000 B / beta + collective)
    assert _comm.in_step_allreduces_s(2, 4, 4000, net) == pytest.approx(4 * (2e-5 + 1e-6 + 1e-4), rel=1e-12)
    assert _comm.in_step_allreduces_s(1, 4, 4000, net) == 0.0  # a group of one exchanges nothing
    assert tnt.auto.Network(collective_s=np.float32(1e-4)).collective_s == np.float32(1e-4)  # numpy numbers too
    for bad in ({"collective_s": -1e-3}, {"alpha_s": float("nan")}, {"beta_Bps": 0}, {"collective_s": "1 ms"}):
        with pytest.raises(ValueError, match=rf"tnt\.auto\.Network\({next(iter(bad))}=\.\.\.\)"):
            tnt.auto.Network(**bad)

    inp = keras.Input((16,))
    x = keras.layers.Dense(64, name="up")(inp)  # column-split, then row-split: one pair,
    x = keras.layers.Dense(16, name="down")(x)  # one allreduce forward and one backward
    mlp = keras.Model(inp, keras.layers.Dense(4, name="head")(x))
    delta = 1e-3

    def comm(model, batch, prof=None) -> tuple[dict[str, float], dict[str, float]]:
        out = []
        for c_s in (0.0, delta):
            plan = tnt.plan_parallel(model, num_ranks=2, global_batch_size=batch, memory_budget=None, profile_=prof,
                                     network=tnt.auto.Network(alpha_s=1e-5, beta_Bps=1e9, collective_s=c_s))
            out.append({c.layout.describe(): c.estimate.comm_s for c in plan.feasible})
        return out[0], out[1]

    prof = given_profile(mlp, {"up": 1e-4, "down": 1e-4, "head": 1e-5})
    without, charged = comm(mlp, 8, prof)
    assert charged["TENSOR(d=1, t=2)"] - without["TENSOR(d=1, t=2)"] == pytest.approx(2 * delta, rel=1e-9)
    assert charged["DATA(d=2)"] == without["DATA(d=2)"]
    # sharding 1: one bucket of gathered weights; 2: and one of reduce-scattered gradients
    assert charged["DATA(d=2, sharding=1)"] - without["DATA(d=2, sharding=1)"] == pytest.approx(delta, rel=1e-9)
    assert charged["DATA(d=2, sharding=2)"] - without["DATA(d=2, sharding=2)"] == pytest.approx(2 * delta, rel=1e-9)
    # level 3 of sixteen convolutions: per layer two gathers and a reduce-scatter; nothing trained whole
    convs = sixteen_convs()
    prof = given_profile(convs, {**{f"c{i}": 1e-4 for i in range(16)}, "shared_bn": 0.0})
    without, charged = comm(convs, 2, prof)
    level3 = "DATA(d=2, sharding=3)"
    assert charged[level3] - without[level3] == pytest.approx(3 * 16 * delta, rel=1e-9)


def test_time_balanced_plan_cuts_where_time_balances_not_where_bytes_do():
    inp = keras.Input((64,))
    x = keras.layers.Dense(512, name="d1")(inp)   # most of the bytes
    x = keras.layers.Dense(8, name="d2")(x)
    x = keras.layers.Dense(8, name="d3")(x)
    m = keras.Model(inp, keras.layers.Dense(8, name="d4")(x))
    # given times: d4 dominates (as a layer with few weights and much compute would)
    prof = given_profile(m, {"d1": 1e-4, "d2": 1e-4, "d3": 1e-4, "d4": 5e-4})
    by_time = tnt.auto.time_balanced_plan(m, 2, 8, profile_=prof)
    assert by_time.split_after == ["d3"], by_time.split_after
    assert tnt.pipelining.plan(m, 2).split_after == ["d1"]  # the default: bytes
    measured = tnt.auto.time_balanced_plan(m, 2, 8)  # timed here: some valid 2-stage cut
    assert measured.num_stages == 2 and measured.split_after[0] in {"d1", "d2", "d3"}
    with pytest.raises(tnt.auto.StagePlanError, match="fewer than num_stages=5"):
        tnt.auto.time_balanced_plan(m, 5, 8, profile_=prof)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive integer"):
        tnt.auto.time_balanced_plan(m, 2, 0)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="micro_batches must be a positive integer"):
            tnt.auto.time_balanced_plan(m, 2, 8, micro_batches=bad, profile_=prof)


def test_profile_file_is_kept_and_reused_for_the_same_model_only(tmp_path):
    m = two_convs()
    path = tmp_path / "profile.json"
    first = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, profile_file=str(path))
    stored = path.read_text()
    assert '"layers"' in stored and '"c1"' in stored
    again = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, profile_file=str(path))
    assert any("profile read from" in n for n in again.notes)  # measured nothing
    assert again.step_time_s == first.step_time_s and again.layout == first.layout
    other = tnt.plan_parallel(m, num_ranks=2, global_batch_size=16, profile_file=str(path))  # other rows
    assert not any("profile read from" in n for n in other.notes)


def _profile_of(times: list[float]) -> Profile:
    return Profile("m", [LayerCost(f"l{i}", 4, 4, 4, 0.0, t, True) for i, t in enumerate(times)], (1,))


def test_layers_are_timed_under_op_determinism():
    # TF_DETERMINISTIC_OPS=1 (as every launched test sets): unseeded random inputs raised and
    # every layer fell back to the FLOP proxy (found in CI, where another module enables it)
    tf.config.experimental.enable_op_determinism()
    prof = profile(two_convs(), [2, 8])
    assert [c.measured for c in prof.layers] == [True] * len(prof.layers), prof.notes
    assert not [n for n in prof.notes if "FLOP proxy" in n], prof.notes


def test_attention_embeddings_and_keras_hub_blocks_are_timed_as_their_model_calls_them():
    # Note [Layers timed as their model calls them]: MultiHeadAttention called as mha(h, h) was
    # called with a list and an Embedding's IndexedSlices gradient could not be fetched: both fell
    # back to the FLOP proxy (attention priced by its weights only); a keras-hub block takes a
    # keyword mask.
    import keras_hub

    tokens = keras.Input((16,), dtype="int32")
    h = keras.layers.Embedding(100, 32, name="emb")(tokens)
    h = keras.layers.MultiHeadAttention(2, 16, name="mha")(h, h)
    mask = keras.layers.Lambda(lambda t: keras.ops.not_equal(t, 0), name="mask")(tokens)
    h = keras_hub.layers.TransformerEncoder(64, 2, name="block")(h, padding_mask=mask)
    out = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling1D(name="pool")(h))
    prof = profile(keras.Model(tokens, out), [2, 8])
    assert {c.name: c.measured for c in prof.layers} == dict.fromkeys(
        ["emb", "mha", "mask", "block", "pool", "head"], True), prof.notes
    assert not [n for n in prof.notes if "FLOP proxy" in n], prof.notes
    assert prof.call_s > 0 and all(c.a_s >= 0 and c.b_s >= 0 for c in prof.layers)


def test_a_functions_fixed_cost_once_per_step_and_the_pipelines_own_cost_per_step_and_micro_batch():
    # Note [Layers timed as their model calls them]: the layers' times are net of a call's fixed
    # cost, charged once per step; Note [The pipeline's own cost]: a pipeline stage's executor
    # costs per step and per micro-batch in each of the m + p - 1 slots (two calls per
    # micro-batch where it was not measured).
    import dataclasses

    m = two_convs()
    free = given_profile(m, {"c1": 1e-4, "c2": 1e-4, "pool": 0.0, "head": 0.0})
    called = dataclasses.replace(free, call_s=1e-3)
    executor = dataclasses.replace(called, pipeline_step_s=5e-3, pipeline_micro_batch_s=3e-3)

    def compute(p) -> dict:
        plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=None, profile_=p)
        return {c.layout.describe(): (c.layout, c.estimate.compute_s) for c in plan.feasible}

    stepped = dataclasses.replace(executor, step_s=2e-3)  # Note [A step's own cost]
    without, with_call, with_executor, with_step = compute(free), compute(called), compute(executor), compute(stepped)
    assert with_call.keys() == without.keys() == with_executor.keys() == with_step.keys()
    for name, (layout, seconds) in without.items():
        slots = layout.micro_batches + layout.stages - 1
        piped = layout.stages > 1
        assert with_call[name][1] - seconds == pytest.approx(2e-3 * slots if piped else 1e-3, rel=1e-9), name
        assert with_executor[name][1] - seconds == pytest.approx(5e-3 + 3e-3 * slots if piped else 1e-3,
                                                                 rel=1e-9), name
        assert with_step[name][1] - seconds == pytest.approx(5e-3 + 3e-3 * slots if piped else 2e-3,
                                                             rel=1e-9), name
    assert any(layout.stages > 1 for layout, _ in without.values()), sorted(without)


def test_the_pipelines_and_a_keras_steps_own_costs_are_measured():
    from tarantella.auto import _pipeline_overhead, _step_overhead

    assert 0 < _step_overhead.measure() < 0.5  # seconds: the probe's layers are tiny

    per_step, per_micro_batch, per_variable = _pipeline_overhead.measure()
    assert per_micro_batch > 0 and per_variable > 0 and per_step >= 0, (per_step, per_micro_batch, per_variable)
    assert max(per_step, per_micro_batch, per_variable) < 0.5  # seconds: the probe's layers are tiny


def test_a_keras_hub_backbone_is_timed_and_counted_at_the_given_sequence_length(tmp_path):
    # keras-hub backbones leave the sequence open (inputs (None, None)): without a length no
    # layer could be timed (FLOP proxy) and no activation was counted; the summary says so
    import keras_hub

    gpt2 = keras_hub.models.GPT2Backbone(vocabulary_size=500, num_layers=2, num_heads=2, hidden_dim=32,
                                         intermediate_dim=64, max_sequence_length=16)
    blind = profile(gpt2, [2, 8])
    assert not any(c.measured for c in blind.layers)
    assert sum(c.activation_bytes_per_sample for c in blind.layers) == 0
    assert any("transformer_layer_0" in n and "sequence_length=" in n for n in blind.notes), blind.notes
    seen = profile(gpt2, [2, 8], sequence_length=16)
    assert all(c.measured for c in seen.layers), seen.notes
    assert not [n for n in seen.notes if "FLOP proxy" in n or "open" in n], seen.notes
    assert any("scaled to the whole model's measured" in n for n in seen.notes), seen.notes  # dict inputs
    # a block's output: 16 positions x 32 features x 4 bytes per sample, counted by hand
    assert seen.by_name()["transformer_layer_0"].activation_bytes_per_sample == 16 * 32 * 4
    # a pipeline stage's received boundary: at least a block's output, 16 x 32 x 4 bytes per
    # sample (an open dimension was counted as 1: 32 x 4)
    from tarantella.auto._search import _stages

    assert _stages(gpt2, 2, open_size=16).receive_bytes_per_sample[1] >= 16 * 32 * 4
    assert _stages(gpt2, 2).receive_bytes_per_sample[1] < 16 * 32 * 4
    path = tmp_path / "profile.json"
    kwargs = dict(num_ranks=2, global_batch_size=8, profile_file=str(path))
    tnt.plan_parallel(gpt2, sequence_length=16, **kwargs)
    again = tnt.plan_parallel(gpt2, sequence_length=16, **kwargs)
    assert any("profile read from" in n for n in again.notes)
    other = tnt.plan_parallel(gpt2, sequence_length=8, **kwargs)  # another length: measured anew
    assert not any("profile read from" in n for n in other.notes)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"sequence_length=.*positive integer"):
            tnt.plan_parallel(gpt2, num_ranks=2, global_batch_size=8, sequence_length=bad)
    # a given profile measured at one length cannot plan another (its boundaries and times disagree)
    with pytest.raises(ValueError, match=r"measured at sequence_length=16, not 8"):
        tnt.plan_parallel(gpt2, num_ranks=2, global_batch_size=8, sequence_length=8, profile_=seen)
    with pytest.raises(ValueError, match=r"measured at sequence_length=None, not 16"):
        tnt.plan_parallel(gpt2, num_ranks=2, global_batch_size=8, sequence_length=16, profile_=blind)


def test_planning_leaves_batch_norm_statistics_and_every_other_variable_as_they_were():
    # Note [Profiling leaves the model as it was]: layers are timed in training mode; before,
    # plan_parallel moved a BatchNormalization's moving mean and variance (random inputs), so a
    # model AUTO planned finished training with statistics serial Keras never had
    keras.utils.set_random_seed(5)
    inp = keras.Input((8,))
    x = keras.layers.Dense(16, name="d")(inp)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Dropout(0.5, name="drop")(x)
    m = keras.Model(inp, keras.layers.Dense(2, name="head")(x))
    before = {v.path: np.array(v.numpy(), copy=True) for v in m.variables}
    assert {"bn/moving_mean", "bn/moving_variance"} <= set(before), sorted(before)
    assert np.all(before["bn/moving_mean"] == 0) and np.all(before["bn/moving_variance"] == 1)
    tnt.plan_parallel(m, num_ranks=2, global_batch_size=8)
    tnt.auto.time_balanced_plan(m, 2, 4)
    for v in m.variables:
        np.testing.assert_array_equal(v.numpy(), before[v.path], err_msg=v.path)
    # a keras.applications model: 27 BatchNormalization layers, every layer timed, the sum scaled
    net = keras.applications.MobileNet(alpha=0.25, input_shape=(32, 32, 3), weights=None, classes=10)
    before = {v.path: np.array(v.numpy(), copy=True) for v in net.variables}
    plan = tnt.plan_parallel(net, num_ranks=2, global_batch_size=8)
    assert sum(isinstance(layer, keras.layers.BatchNormalization) for layer in net.layers) == 27
    for v in net.variables:
        np.testing.assert_array_equal(v.numpy(), before[v.path], err_msg=v.path)
    assert any("scaled to the whole model's measured" in n for n in plan.notes), plan.notes
    assert not [n for n in plan.notes if "FLOP proxy" in n], plan.notes


def _fake_whole(monkeypatch, seconds):
    """The whole model's forward + backward timed as ``seconds(rows)`` plus a call's fixed cost."""
    from tarantella.auto import _profile as profile_module

    monkeypatch.setattr(profile_module, "_whole_timer", lambda model, open_size=None: (
        lambda rows, callers=1: (profile_module._call_overhead_s() + seconds(rows)) * (1 if callers == 1 else slower)))


slower = 1.0  # what concurrent callers take against one (the fake whole model's contention)


def test_layer_times_are_scaled_so_that_their_sum_is_the_whole_models(monkeypatch):
    # Note [Layers scaled to the whole model]: hand-made layer times, a whole model timed at
    # half their sum's intercept and a quarter of its per-row time (a proxied layer's time
    # taken off first): each timed layer's a and b scaled by 0.5 and 0.25, the proxied layer as it was
    from tarantella.auto._profile import _scaled_to_whole

    costs = [LayerCost("x", 0, 0, 0, 2e-3, 1e-4, True), LayerCost("y", 0, 0, 0, 2e-3, 3e-4, True),
             LayerCost("z", 0, 0, 0, 0.0, 5e-5, False)]
    # whole = (4e-3 * 0.5) + (4e-4 * 0.25) * rows, plus the proxied layer's 5e-5 * rows
    _fake_whole(monkeypatch, lambda rows: 2e-3 + 1e-4 * rows + 5e-5 * rows)
    from tarantella.auto._profile import _call_overhead_s

    scaled, note, _ = _scaled_to_whole(two_convs(), costs, [4, 32], None, _call_overhead_s())
    got = {c.name: (c.a_s, c.b_s) for c in scaled}
    assert got["x"] == pytest.approx((1e-3, 2.5e-5), rel=1e-6) and got["y"] == pytest.approx((1e-3, 7.5e-5), rel=1e-6)
    assert got["z"] == (0.0, 5e-5)
    assert "intercepts x0.50, per-row times x0.25" in note, note
    # a whole model timed 100x faster than its layers: the factors stop at 1/4 (a noisy fit)
    _fake_whole(monkeypatch, lambda rows: 0.01 * (4e-3 + 4e-4 * rows) + 5e-5 * rows)
    scaled, note, _ = _scaled_to_whole(two_convs(), costs, [4, 32], None, _call_overhead_s())
    assert {c.name: (c.a_s, c.b_s) for c in scaled}["x"] == pytest.approx((5e-4, 2.5e-5), rel=1e-6)
    assert "intercepts x0.25, per-row times x0.25" in note, note


def test_ranks_sharing_the_hosts_cores_slow_the_steps_of_layouts_without_stages(monkeypatch):
    # Note [Ranks that share a host's cores]: the whole model's pass with as many callers at
    # once as ranks on the host, against one alone (kept within 1 and the rank count)
    from tarantella.auto._profile import _call_overhead_s, _scaled_to_whole

    costs = [LayerCost("x", 0, 0, 0, 1e-3, 1e-4, True)]
    _fake_whole(monkeypatch, lambda rows: 1e-3 + 1e-4 * rows)
    for factor, expected in ((1.5, 1.5), (5.0, 2.0), (0.5, 1.0)):
        monkeypatch.setattr(__import__(__name__), "slower", factor)
        _, note, contention = _scaled_to_whole(two_convs(), costs, [4, 32], None, _call_overhead_s(), 2)
        assert contention == pytest.approx(expected, rel=1e-3), (factor, contention)
        assert f"2 ranks computing at once on this host slow that pass x{expected:.2f}" in note, note
    _, note, contention = _scaled_to_whole(two_convs(), costs, [4, 32], None, _call_overhead_s(), 1)
    assert contention == 1.0 and "at once" not in note
    # 16 ranks on the host: 8 callers measured (x1.5), the other 8 taken as slowing it in proportion
    monkeypatch.setattr(__import__(__name__), "slower", 1.5)
    calls = []
    from tarantella.auto import _profile as profile_module

    timer = profile_module._whole_timer
    monkeypatch.setattr(profile_module, "_whole_timer", lambda model, open_size=None: (
        lambda rows, callers=1: (calls.append(callers), timer(model)(rows, callers))[1]))
    _, _, contention = _scaled_to_whole(two_convs(), costs, [4, 32], None, _call_overhead_s(), 16)
    assert contention == pytest.approx(3.0, rel=1e-3) and max(calls) == 8, (contention, calls)
    # charged to DATA's and TENSOR's compute (layers, update, a step's own cost), not to a pipeline's
    import dataclasses

    m = two_convs()
    base = dataclasses.replace(given_profile(m, {"c1": 1e-4, "c2": 1e-4, "pool": 0.0, "head": 1e-5}),
                               update_s_per_byte=1e-9, step_s=1e-3)
    shared = dataclasses.replace(base, contention=1.5)

    def compute(p) -> dict[str, float]:
        plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=8, memory_budget=None, profile_=p)
        return {c.layout.describe(): c.estimate.compute_s for c in plan.feasible}

    alone, together = compute(base), compute(shared)
    assert together["DATA(d=2)"] == pytest.approx(1.5 * alone["DATA(d=2)"], rel=1e-9)
    piped = [k for k in alone if k.startswith("PIPELINING")]
    assert piped and all(together[k] == alone[k] for k in piped), (alone, together)
    # measured on a real model with 2 callers: a factor within its bounds, said in the notes
    prof = profile(m, [2, 8], ranks_on_host=2)
    assert 1.0 <= prof.contention <= 2.0 and prof.ranks_on_host == 2
    assert any("2 ranks computing at once on this host" in n for n in prof.notes), prof.notes
    from tarantella.auto import _cache

    assert _cache.key(m, [2, 8], None, 2) != _cache.key(m, [2, 8])  # a kept profile is per sharing too


def test_a_real_models_layers_sum_to_its_whole_pass_unless_memory_or_a_subclassed_model_says_why_not():
    # The profile of a functional model is scaled (its note names the factors); a subclassed
    # model, whose inputs are not known, keeps its layers' own times and says so
    from tarantella.auto import _profile as profile_module

    m = two_convs()
    whole = profile_module._whole_timer(m)
    assert whole is not None
    prof = profile(m, [2, 8])
    assert any(n.startswith("layers' times scaled to the whole model's measured forward + backward")
               for n in prof.notes), prof.notes

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    # a whole pass this rank's memory could not hold is not run (a model too large for one
    # process is what AUTO spreads): the layers keep their own times, and the note says why
    with pytest.MonkeyPatch.context() as mp:
        # two_convs at 8 rows: 296,464 gradient bytes + 2 x 8,464 activation bytes x 8 rows = 0.4 MiB
        mp.setattr(profile_module._budget, "default_budget", lambda n: (1 << 19, "a 0.5 MiB share"))
        small = profile(m, [2, 8])
    assert any("not scaled to the whole model (its pass would hold about 0.4 MiB, over half of this rank's "
               "0.5 MiB)" in n for n in small.notes), small.notes
    # one pass fits half a 1.2 MB share, two at once (2 ranks on the host) would not: scaled,
    # the host's cores not measured, and the notes say so
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(profile_module._budget, "default_budget", lambda n: (1_200_000, "a 1.2 MB share"))
        tight = profile(m, [2, 8], ranks_on_host=2)
    assert tight.contention == 1.0
    assert any("scaled to the whole model's measured" in n and "the host's cores not measured (2 passes at once "
               "would not fit)" in n for n in tight.notes), tight.notes
    sub = Sub()
    sub(np.zeros((1, 3), np.float32))
    assert profile_module._whole_timer(sub) is None
    note = profile_module._scaled_to_whole(sub, [LayerCost("dense", 0, 0, 0, 1e-3, 1e-4, True)], [2, 8], None,
                                           0.0)[1]
    assert "not scaled to the whole model (its inputs are not known" in note, note


def test_a_layer_that_needs_its_batch_size_while_traced_is_still_timed():
    # layers (and the whole model) are traced once for every row count, the batch dimension
    # left open; a layer that reads its static batch size while traced fails so, and is traced
    # again per row count, with static shapes, rather than priced by the FLOP proxy
    class StaticBatch(keras.layers.Layer):
        def call(self, x):
            return tf.reshape(x, (x.shape[0], -1)) * 2.0

        def compute_output_shape(self, shape):
            return shape

    inp = keras.Input((8,))
    x = keras.layers.Dense(8, name="d")(inp)
    m = keras.Model(inp, StaticBatch(name="static_batch")(x))
    prof = profile(m, [2, 8])
    assert prof.by_name()["static_batch"].measured, prof.notes
    assert not [n for n in prof.notes if "FLOP proxy" in n or "not scaled" in n], prof.notes


def test_identical_layers_are_timed_once_and_others_on_their_own():
    # Note [Identical layers timed once]: same class, config but the name, and input shapes
    inp = keras.Input((16,))
    x = keras.layers.Dense(16, activation="relu", name="a")(inp)
    x = keras.layers.Dense(16, activation="relu", name="b")(x)
    x = keras.layers.Dense(16, activation="relu", name="c")(x)
    x = keras.layers.Dense(16, activation="tanh", name="other_activation")(x)
    x = keras.layers.Dense(24, activation="relu", name="other_width")(x)
    prof = profile(keras.Model(inp, x), [2, 8])
    cost = prof.by_name()
    assert (cost["b"].a_s, cost["b"].b_s) == (cost["a"].a_s, cost["a"].b_s)
    assert (cost["c"].a_s, cost["c"].b_s) == (cost["a"].a_s, cost["a"].b_s)
    assert all(c.measured for c in prof.layers)
    assert any(n.startswith("2 layer(s) priced as an identical layer") for n in prof.notes), prof.notes
    # weights and activations stay per layer
    assert cost["other_width"].weight_bytes == 4 * (16 * 24 + 24) and cost["other_width"].activation_bytes_per_sample == 96


def test_time_partition_minimises_the_slowest_stage():
    # the only best cuts, worked out by hand: [5, 1 | 1, 1, 4] (slowest 6), [6 | 1, 2, 3 | 4] (6)
    assert time_split_after(_profile_of([5, 1, 1, 1, 4]), 2, rows=1) == ["l1"]
    assert time_split_after(_profile_of([6, 1, 2, 3, 4]), 3, rows=1) == ["l0", "l3"]
    assert time_split_after(_profile_of([1, 1, 1, 1]), 2, rows=1) == ["l1"]
    assert time_split_after(_profile_of([1]), 2, rows=1) is None
    # with the micro-batches per step, a stage's time is m passes plus its variables' per-step
    # cost: l3's 4 variables at 1 s each make [2, 2, 2 | 2 + 4] (slowest 6) beat [2, 2 | 2, 6] (8)
    import dataclasses

    flat = _profile_of([1, 1, 1, 1])
    layers = [dataclasses.replace(c, trainable_variables=4 if c.name == "l3" else 0, trainable_bytes=0)
              for c in flat.layers]
    heavy = dataclasses.replace(flat, layers=layers, pipeline_variable_s=1.0, update_s_per_byte=0.0)
    assert time_split_after(heavy, 2, rows=1) == ["l1"]
    assert time_split_after(heavy, 2, rows=1, micro_batches=2) == ["l2"]


def test_pipelines_are_predicted_with_both_partitions():
    inp = keras.Input((16, 16, 8))
    x = keras.layers.Conv2D(32, 3, padding="same", name="c1")(inp)  # time, few bytes
    x = keras.layers.Conv2D(32, 3, padding="same", name="c2")(x)
    x = keras.layers.Conv2D(32, 3, padding="same", name="c3")(x)
    x = keras.layers.Flatten(name="flat")(x)
    out = keras.layers.Dense(16, name="d1")(x)  # most bytes, little time
    m = keras.Model(inp, out)
    # the layers' times given, not measured (a measured profile made the cut depend on the
    # machine's load: CI once found no time cut differing from the bytes cut)
    prof = given_profile(m, {"c1": 1e-3, "c2": 1e-3, "c3": 1e-3, "flat": 0.0, "d1": 1e-5})
    plan = tnt.plan_parallel(m, num_ranks=2, global_batch_size=16, memory_budget=100 * weight_bytes(m),
                             profile_=prof)
    pipes = [c.layout for c in plan.feasible if c.layout.stages == 2]
    assert {lay.partition for lay in pipes} == {"bytes", "time"}, plan.summary()
    by_bytes = tuple(tnt.pipelining.plan(m, 2).split_after)  # the pipeline's own plan: d1 alone
    assert by_bytes in {("c3",), ("flat",)}, by_bytes
    assert all(lay.split_after == by_bytes for lay in pipes if lay.partition == "bytes")
    # the convolutions hold the time: a time-balanced cut falls between them
    assert any(lay.split_after in {("c1",), ("c2",)} for lay in pipes if lay.partition == "time"), plan.summary()


def test_stage_cuts_that_split_a_tensor_pair_are_rejected_not_chosen():
    """ALL refuses stages that put a column-split layer and its row-split partner apart
    (their activations are split over the tensor group); the planner must not offer them
    (a 4-rank benchmark once chose one and crashed building it)."""
    inp = keras.Input((64,))
    x = keras.layers.Dense(256, activation="relu", name="up")(inp)
    x = keras.layers.Dense(64, name="down")(x)
    out = keras.layers.Dense(64, name="head")(x)
    m = keras.Model(inp, out)
    # the time-balanced cut of two stages falls between the pair's two layers
    prof = given_profile(m, {"up": 1e-3, "down": 1e-3, "head": 1e-6})
    plan = tnt.plan_parallel(m, num_ranks=4, global_batch_size=32, memory_budget=100 * weight_bytes(m),
                             profile_=prof)
    apart = [c for c in plan.rejected if c.rejected and "tensor pair split by the stage cut" in c.rejected]
    assert apart and all(c.layout.tensor > 1 and c.layout.stages > 1 for c in apart), plan.summary()
    tp = tnt.tensor_parallel.plan(m, tensor_parallel_size=2)
    for c in plan.feasible:  # every offered stages-of-tensor-groups layout builds
        if c.layout.tensor > 1 and c.layout.stages > 1:
            tnt.hybrid.check_pairs_in_one_stage(tp, tnt.pipelining.plan(m, split_after=list(c.layout.split_after)))


share(__name__, 2, "auto", "auto.py")  # in the shared 2-rank launch (shared_launch.py)


@pytest.fixture(scope="module")
def launched(shared_launches):
    res = shared_launches.result(2, "auto")
    print("\n" + res["summary"])
    return res


def test_auto_under_a_budget_below_data_trains_as_serial_keras(launched):
    r = launched
    assert r["ranks"] == 2
    assert r["budget"] < 5 * r["weight_bytes"]  # plain DATA with Adam does not fit
    assert r["plans_on_ranks"] == [r["chosen"]] * 2  # every rank built the same layout
    assert r["chosen"] != "DATA(d=2)"
    assert r["strategy"] != "DATA" or r["sharding"] in (1, 2)
    assert r["predicted_total"] <= r["budget"]
    # the built layout's own estimate (memory_report) agrees with the planner's within 15 %
    for total in r["layout_estimate_totals"]:
        assert total <= r["budget"] and abs(total - r["predicted_total"]) <= 0.15 * total, r
    assert r["history_diff"] <= TOL_LOSS, r
    assert r["weight_diff"] <= TOL_WEIGHTS, r
    e = r.get("edited")
    assert e is not None and e["plan_layout"] == e["layout"], r
    assert e["history_diff"] <= TOL_LOSS and e["weight_diff"] <= TOL_WEIGHTS, e
    pipe = r.get("pipeline")  # a pipeline layout of the plan, built from its cut points
    assert pipe is not None and pipe["plan_layout"] == pipe["layout"] and "PIPELINING" in pipe["layout"], r
    assert pipe["model_type"] == "PipelinedModel" and pipe["split_after"] == pipe["built_split_after"], pipe
    assert pipe["history_diff"] <= TOL_LOSS and pipe["weight_diff"] <= TOL_WEIGHTS, pipe


def test_auto_prices_the_plan_with_the_network_it_measured_in_the_job(launched):
    """AUTO times the job's allreduce before it plans: its alpha and beta predict the
    8 MiB allreduce the job times on its own, later, within a factor of 6 — loose, as the
    shared 2-core machine's load moves both timings 1-4x (measured), but tight enough to
    catch a unit slip (us for s, bits for bytes)."""
    n = launched["network"]
    assert n["name"].startswith("measured in this job"), n
    assert 0 < n["alpha_s"] < 1e-2 and n["beta_Bps"] > 1e6, n
    ranks = launched["ranks"]
    predicted = 2 * (ranks - 1) * n["alpha_s"] + 2 * (ranks - 1) / ranks * n["nbytes"] / n["beta_Bps"]
    assert n["allreduce_8mib_s"] / 6 <= predicted <= 6 * n["allreduce_8mib_s"], (predicted, n)
    # Note [A collective inside a step]: measured too, in seconds (a unit slip is 1e6 off;
    # 10-300 us seen on this machine, the first calls of a process being the slowest)
    assert 0 < n["collective_s"] < 0.01, n


def test_time_balanced_stages_are_rank_0s_on_every_rank(launched):
    """Rank 0's profile puts the time in the last layer, rank 1's in the first: both ranks
    cut before the last layer (each on its own would cut after the first)."""
    cuts = launched["time_balanced_cuts"]
    assert cuts == [["d3"], ["d3"]], cuts


def test_auto_at_sharding_3_keeps_a_deferred_model_deferred_and_trains_as_serial_keras(launched):
    r = launched["level3"]
    assert r["chosen"] == "DATA(d=2, sharding=3)", r
    assert r["materialise_calls"] == 0, r  # never whole: each replica gave values to its part only
    # each replica stores 8 of the 16 kernels and 8 of the biases (largest first, least loaded;
    # the frozen norm trains nothing)
    assert r["held_trainable_bytes"] == [8 * 4 * (3 * 3 * 64 * 64 + 64)] * 2, r
    for total in r["layout_estimate_totals"]:  # the built model's memory_report, as planned
        assert total <= r["budget"] and abs(total - r["predicted_total"]) <= 0.05 * total, r
    assert r["history_diff"] <= TOL_LOSS and r["weight_diff"] <= TOL_WEIGHTS, r
