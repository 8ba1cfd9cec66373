"""ParallelStrategy.AUTO on 2 ranks under a memory budget too small for plain DATA
(issue 31): the plan every rank reached, the layout built, and training against serial
Keras in the same job; then an edited plan passed back with ``plan=``; then a model built
under ``tnt.deferred_variables()`` whose budget only DATA at sharding=3 meets (AUTO keeps it
deferred: each replica gives values to what it stores only). Rank 0 writes the JSON that
tests/test_auto.py checks.
"""

from __future__ import annotations

import dataclasses
import time

import _job
import keras
import numpy as np

import tarantella as tnt
import tnt_comm

EPOCHS, BATCH, WIDTH = 2, 16, 192


def make_model() -> keras.Model:
    keras.utils.set_random_seed(11)
    inp = keras.Input((32,))
    x = keras.layers.Dense(WIDTH, activation="tanh", name="d1")(inp)
    x = keras.layers.Dense(WIDTH, activation="tanh", name="d2")(x)
    x = keras.layers.Dense(WIDTH, activation="tanh", name="d3")(x)
    out = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inp, out)


def data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(64, 32)).astype("float32"), rng.integers(0, 4, size=64)


def compile_(m) -> None:
    m.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def serial() -> tuple[dict, list]:
    m = make_model()
    compile_(m)
    x, y = data()
    h = m.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return h.history, m.get_weights()


def trained(model) -> tuple[dict, list]:
    compile_(model)
    x, y = data()
    h = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return h.history, model.get_weights()


def make_convs() -> keras.Model:
    """Sixteen equal convolutions (nothing a tensor group splits) between two calls of one
    frozen BatchNormalization (``trainable = False``, as in fine-tuning): no pipeline cut (its
    moving statistics would be on two stages); level 3 gathers 1/16 at a time."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((2, 2, 64))
    norm = keras.layers.BatchNormalization(name="shared_bn")
    norm.trainable = False  # frozen, as in fine-tuning: Keras 3 then runs it in inference mode
    x = norm(inp)
    for i in range(16):
        x = keras.layers.Conv2D(64, 3, padding="same", activation="tanh", name=f"c{i}")(x)
    return keras.Model(inp, norm(x))


def level3_case() -> dict:
    """AUTO under a budget only DATA(d=2, sharding=3) meets, with the model built deferred."""
    import tarantella.auto._strategy as auto_strategy

    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(16, 2, 2, 64)).astype("float32"), rng.normal(size=(16, 2, 2, 64)).astype("float32")

    def train(m) -> tuple[dict, list]:
        m.compile(keras.optimizers.Adam(0.01), "mse")
        h = m.fit(x, y, batch_size=BATCH // 2, epochs=1, shuffle=False, verbose=0)
        return h.history, m.get_weights()

    ref_hist, ref_weights = _job.timed("level-3 serial fit", lambda: train(make_convs()))
    w = 4 * make_convs().count_params()
    # By hand (tests/test_auto.py): level 3 holds about 2.375 w + activations per rank (with the
    # update's temporaries, 2 copies of one layer), level 1/2 3.1 w, plain DATA 4.1 w; no 2-stage
    # pipeline (the shared norm).
    budget = int(2.45 * w)
    with tnt.deferred_variables():
        deferred = make_convs()
    calls = []
    whole = auto_strategy.materialise
    auto_strategy.materialise = lambda model: (calls.append(model.name), whole(model))
    try:
        model = _job.timed("level-3 plan and build", lambda: tnt.Model(
            deferred, parallel_strategy=tnt.ParallelStrategy.AUTO, global_batch_size=BATCH // 2, memory_budget=budget))
    finally:
        auto_strategy.materialise = whole
    from tarantella._core.deferred import is_deferred

    held = sum(4 * int(np.prod(v.shape)) for v in deferred.trainable_variables if not is_deferred(v))
    hist, weights = _job.timed("auto level-3 fit", lambda: train(model))
    return {"chosen": model._tnt_plan.layout.describe(), "weight_bytes": w, "budget": budget,
            "materialise_calls": len(calls), "held_trainable_bytes": tnt_comm.allgather_object(held),
            "predicted_total": model._tnt_plan.choice.estimate.total_bytes,
            "layout_estimate_totals": tnt_comm.allgather_object(model.memory_report()["total_bytes"]),
            "history_diff": _job.history_diff(hist, ref_hist), "weight_diff": _job.max_abs_diff(weights, ref_weights)}


def time_balanced_cuts() -> list[list[str]]:
    """PIPELINING's stages by time on every rank. Each rank is handed a profile that cuts
    elsewhere (rank 0: the last layer dominates; the others: the first): every rank must
    take rank 0's cut, not its own."""
    model = make_model()
    measured = tnt.auto.profile(model, [BATCH // 4])
    heavy = len(measured.layers) - 1 if tnt.get_rank() == 0 else 0
    layers = [dataclasses.replace(c, a_s=0.0, b_s=1e-3 if i == heavy else 1e-6) for i, c in enumerate(measured.layers)]
    given = dataclasses.replace(measured, layers=layers)
    timed = tnt.auto.time_balanced_plan(model, 2, BATCH // 4, profile_=given)
    return tnt_comm.allgather_object(list(timed.split_after))


def network_check(plan) -> dict:
    """The network AUTO's plan was priced with (alpha, beta measured by the job before it
    planned) and this job's own timing of an 8 MiB allreduce, to set beside the time the
    measured alpha and beta predict for it."""
    buf = np.ones(2 << 20, dtype=np.float32)  # 8 MiB
    tnt_comm.allreduce(buf)
    seconds = []
    for _ in range(5):
        tnt_comm.barrier()
        t0 = time.perf_counter()
        tnt_comm.allreduce(buf)
        seconds.append(time.perf_counter() - t0)
    return {"name": plan.network.name, "alpha_s": plan.network.alpha_s, "beta_Bps": plan.network.beta_Bps,
            "allreduce_8mib_s": max(tnt_comm.allgather_object(min(seconds))),
            "nbytes": buf.nbytes, "collective_s": plan.network.collective_s}


def main() -> None:
    out = _job.out_path()
    ref_hist, ref_weights = serial()
    probe = make_model()
    # The budget, counted here from the shapes (not by the planner): plain DATA with Adam holds
    # weights + gradients + 2 slots + the engine's gradient buffer = 5 x the weights' bytes.
    weight_bytes = 4 * probe.count_params()
    budget = int(4.2 * weight_bytes)
    model = tnt.Model(probe, parallel_strategy=tnt.ParallelStrategy.AUTO, global_batch_size=BATCH,
                      memory_budget=budget)
    plan = model._tnt_plan
    everyone = tnt_comm.allgather_object(plan.layout.describe())
    hist, weights = _job.timed("auto fit", lambda: trained(model))
    layout_totals = tnt_comm.allgather_object(model.memory_report()["total_bytes"])
    res = {
        "ranks": tnt.get_size(), "weight_bytes": weight_bytes, "budget": budget,
        "plans_on_ranks": everyone, "chosen": plan.layout.describe(), "strategy": plan.layout.strategy.name,
        "sharding": plan.layout.sharding, "stages": plan.layout.stages, "tensor": plan.layout.tensor,
        "predicted_total": plan.choice.estimate.total_bytes, "predicted_step_s": plan.step_time_s,
        "model_type": type(model).__name__, "summary": plan.summary(print_fn=None),
        "history_diff": _job.history_diff(hist, ref_hist), "weight_diff": _job.max_abs_diff(weights, ref_weights),
        "layout_estimate_totals": layout_totals,
    }
    # An edited plan passed back: the fastest feasible layout that is not the chosen one.
    other = next((c.layout for c in plan.feasible if c.layout != plan.layout), None)
    if other is not None:
        with tnt.deferred_variables():  # as AUTO is meant to be used; DATA materialises it
            fresh = make_model()
        edited = tnt.Model(fresh, plan=plan.with_layout(other))
        h2, w2 = _job.timed("edited plan fit", lambda: trained(edited))
        res["edited"] = {"layout": other.describe(), "plan_layout": edited._tnt_plan.layout.describe(),
                         "history_diff": _job.history_diff(h2, ref_hist),
                         "weight_diff": _job.max_abs_diff(w2, ref_weights)}
    # A pipeline layout passed back: its stages are the plan's cut points (time-balanced first).
    pipes = sorted((c.layout for c in plan.feasible if c.layout.stages > 1), key=lambda lay: lay.partition != "time")
    if pipes:
        piped = tnt.Model(make_model(), plan=plan.with_layout(pipes[0]))
        h3, w3 = _job.timed("pipeline plan fit", lambda: trained(piped))
        res["pipeline"] = {"layout": pipes[0].describe(), "plan_layout": piped._tnt_plan.layout.describe(),
                           "model_type": type(piped).__name__, "split_after": list(pipes[0].split_after),
                           "built_split_after": list(piped.plan.split_after),
                           "history_diff": _job.history_diff(h3, ref_hist),
                           "weight_diff": _job.max_abs_diff(w3, ref_weights)}
    res["level3"] = level3_case()
    res["network"] = network_check(plan)
    res["time_balanced_cuts"] = time_balanced_cuts()
    _job.write(out, res)


if __name__ == "__main__":
    main()
