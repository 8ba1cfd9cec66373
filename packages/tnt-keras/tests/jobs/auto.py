"""ParallelStrategy.AUTO on 2 ranks under a memory budget too small for plain DATA
(issue 31): the plan every rank reached, the layout built, and training against serial
Keras in the same job; then an edited plan passed back with ``plan=``. Rank 0 writes the
JSON that tests/test_auto.py checks.
"""

from __future__ import annotations

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
    _job.write(out, res)


if __name__ == "__main__":
    main()
