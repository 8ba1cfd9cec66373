"""The planner checked against measurements (issue 31): ``tnt.plan_parallel``'s predictions
for memory, stage balance and step time against real launches of the layouts it predicts.

    python benchmarks/auto.py [--quick] [--ranks 2,4] [--only memory,plan,plantime] [--models cnn]
                                          (run_all.py: auto; launches its own jobs)

Rows (results/auto.json -> summary.json through summary.py):

- memory_estimate_error: per layout (DATA with sharding 0, 1, 2, 3; PIPELINING p = 2, m = 4,
  with and without remat; TENSOR t = 2; with ``--ranks 4`` also ALL), the planner's
  predicted per-rank bytes (its candidate for that layout) against the measured peak of
  that layout built from the plan (``tnt.Model(model, plan=plan.with_layout(...))``) and
  trained for a few steps: max RSS minus RSS after the imports, the largest rank
  (benchmarks/memory.py's model and measurement). One launch per layout. The value is the
  largest |error|; every layout's signed error is in the detail (target 0.15).
- pipeline_stage_time_balance_p2: the CNN (convolutions early: the compute; large Dense
  late: the parameters) on p = 2 stages, m = 4, the planner's time-balanced partition
  (its candidate with ``partition == "time"``): the median over steps of max / min of the
  stages' compute seconds as the executor times its actions (``pipeline_stats()``
  windows); the bytes-balanced partition's figure beside it, same launch (target 1.10).
- auto_plan_vs_best_measured_<N>ranks: for an MLP stack, a small Transformer and the CNN,
  every feasible layout the planner enumerates (``plan.feasible``) trained in one launch;
  measured samples/s of the planner's choice / the best measured (the worst model is the
  value, target 0.90); auto_step_time_error_max_<N>ranks: the largest
  |predicted / measured step - 1| over every layout of every model (target 0.20).
- auto_plan_seconds_100_blocks_8ranks (``--only plantime``): seconds of ``tnt.plan_parallel``
  in a fresh process for 8 ranks on a 100-block MLP (target 10 s: the issue's "< 10 s for a
  100-layer model"); the same depth with 100 different widths, every layer timed, beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib  # light: no TensorFlow, no MPI at import
import memory as memory_bench  # light too: its measurement helpers and model

HERE = Path(__file__).parent
RESULTS = HERE / "results"
MEM_STEPS = 3
#: name -> (ranks, Layout fields) of the memory row's layouts
MEMORY_LAYOUTS: dict[str, tuple[int, dict]] = {
    "dp2": (2, {"replicas": 2}),
    "dp2_s1": (2, {"replicas": 2, "sharding": 1}),
    "dp2_s2": (2, {"replicas": 2, "sharding": 2}),
    "dp2_s3": (2, {"replicas": 2, "sharding": 3}),
    "pp2": (2, {"replicas": 1, "stages": 2, "micro_batches": 4, "remat": False, "partition": "bytes"}),
    "pp2_remat": (2, {"replicas": 1, "stages": 2, "micro_batches": 4, "remat": True, "partition": "bytes"}),
    "tp2": (2, {"replicas": 1, "tensor": 2}),
    "all_d2p2": (4, {"replicas": 2, "stages": 2, "micro_batches": 4, "remat": False, "partition": "bytes"}),
    "all_p2t2": (4, {"replicas": 1, "stages": 2, "tensor": 2, "micro_batches": 4, "remat": False,
                     "partition": "bytes"}),
}
PLAN_BATCH = 32
WARM_STEPS, TIMED_STEPS = 2, 8


# -- models (explicit layer names: a fresh copy must match the planned one) -------------------
def mlp(keras):
    """An MLP stack: 128 -> 4 x Dense(384) -> 10 (0.5 M parameters)."""
    inp = keras.Input((128,))
    x = inp
    for i in range(4):
        x = keras.layers.Dense(384, activation="relu", name=f"d{i}")(x)
    return keras.Model(inp, keras.layers.Dense(10, name="head")(x), name="mlp")


def transformer(keras):
    """A small Transformer encoder: 32 tokens, vocab 500, d 64, 4 heads, 2 blocks, FFN 256."""
    L = keras.layers
    inp = keras.Input((32,), dtype="int32")
    h = L.Embedding(500, 64, name="emb")(inp)
    for b in range(2):
        a = L.MultiHeadAttention(4, 16, name=f"mha{b}")(h, h)
        h = L.LayerNormalization(name=f"ln{b}a")(L.Add(name=f"res{b}a")([h, a]))
        f = L.Dense(256, activation="relu", name=f"ffn{b}_up")(h)
        f = L.Dense(64, name=f"ffn{b}_down")(f)
        h = L.LayerNormalization(name=f"ln{b}b")(L.Add(name=f"res{b}b")([h, f]))
    h = L.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(inp, L.Dense(10, name="head")(h), name="transformer")


def cnn(keras):
    """Compute and parameters at opposite ends: 3 x 3 convolutions on 32 x 32 first (most
    of the time: 4 M multiply-adds per sample, 7 k parameters), then Dense 2048 -> 512 ->
    512 -> 10 (1.3 M parameters and multiply-adds)."""
    L = keras.layers
    inp = keras.Input((32, 32, 3))
    x = L.Conv2D(16, 3, padding="same", activation="relu", name="c1")(inp)
    x = L.Conv2D(16, 3, padding="same", activation="relu", name="c2")(x)
    x = L.MaxPooling2D(name="p1")(x)
    x = L.Conv2D(32, 3, padding="same", activation="relu", name="c3")(x)
    x = L.MaxPooling2D(name="p2")(x)
    x = L.Flatten(name="flat")(x)
    x = L.Dense(512, activation="relu", name="fc1")(x)
    x = L.Dense(512, activation="relu", name="fc2")(x)
    return keras.Model(inp, L.Dense(10, name="head")(x), name="cnn")


MODELS = {"mlp": mlp, "transformer": transformer, "cnn": cnn}


def data(name: str, n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, n)
    if name == "mlp":
        return rng.standard_normal((n, 128), dtype=np.float32), y
    if name == "transformer":
        return rng.integers(0, 500, (n, 32)).astype("int32"), y
    return rng.standard_normal((n, 32, 32, 3), dtype=np.float32), y


def find(plan, **fields):
    """The plan's candidate (feasible or over budget) whose layout has ``fields``."""
    for c in (*plan.feasible, *plan.rejected):
        if c.estimate is not None and all(getattr(c.layout, k) == v for k, v in fields.items()):
            return c
    raise LookupError(f"no predicted layout with {fields}; the plan has "
                      + ", ".join(c.layout.describe() for c in plan.feasible))


# -- workers (inside mpirun) ------------------------------------------------------------------
def memory_worker(name: str, out: str) -> None:
    import numpy as np
    import tensorflow as tf  # noqa: F401  (in the baseline, as memory.py takes it)

    import tarantella as tnt

    baseline = memory_bench.rss()
    import keras

    keras.utils.set_random_seed(0)
    with tnt.deferred_variables():  # as AUTO is meant to be used: never whole on a rank
        model = memory_bench.mlp(keras)
    ranks, fields = MEMORY_LAYOUTS[name]
    plan = tnt.plan_parallel(model, num_ranks=ranks, global_batch_size=memory_bench.GLOBAL_BATCH,
                             memory_budget="1TiB")
    cand = find(plan, **fields)
    built = tnt.Model(model, plan=plan.with_layout(cand.layout))
    rng = np.random.default_rng(0)
    n = memory_bench.GLOBAL_BATCH * MEM_STEPS
    x = rng.standard_normal((n, memory_bench.IN), dtype=np.float32)
    y = rng.integers(0, memory_bench.CLASSES, n)
    built.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    built.fit(x, y, batch_size=memory_bench.GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    peak = memory_bench.max_rss() - baseline
    report = built.memory_report() if hasattr(built, "memory_report") else None
    rec = {"layout": cand.layout.describe(), "rank": tnt.get_rank(), "peak_bytes": peak,
           "predicted_bytes": cand.estimate.total_bytes, "predicted": cand.estimate.memory,
           "memory_report_total": report and report.get("total_bytes"), "type": type(built).__name__}
    Path(f"{out}.{tnt.get_rank()}.json").write_text(json.dumps(rec, indent=1, default=float))


def _stage_busy(model, tnt_comm) -> list[list[float]]:
    """Per stage (all ranks gathered, stage order), its compute seconds in each step."""
    stats = tnt_comm.allgather_object(model.pipeline_stats())
    by_stage: dict[int, list[float]] = {}
    for s in stats:
        if s.get("replica", 0) == 0:
            by_stage.setdefault(s["stage"], [w[2] for w in s["windows"]])
    return [by_stage[k] for k in sorted(by_stage)]


def plan_worker(names: list[str], out: str, quick: bool) -> None:
    import keras

    import tarantella as tnt
    import tnt_comm

    rank, size = tnt.get_rank(), tnt.get_size()
    result = {}
    for name in names:
        keras.utils.set_random_seed(0)
        probe = MODELS[name](keras)
        t0 = time.perf_counter()
        network = tnt.auto.measure_network()  # as AUTO does in a job: every rank, before rank 0 plans
        plan = tnt.plan_parallel(probe, num_ranks=size, global_batch_size=PLAN_BATCH,
                                 network=network) if rank == 0 else None
        plan_s = time.perf_counter() - t0
        plan = tnt_comm.broadcast_object(plan, root=0)
        x, y = data(name, PLAN_BATCH * max(WARM_STEPS, TIMED_STEPS))
        layouts = []
        feasible = plan.feasible
        if quick:  # the 3 fastest predicted, and the balance row's pipelines
            feasible = [c for i, c in enumerate(plan.feasible) if i < 3 or (
                c.layout.stages > 1 and not c.layout.remat and c.layout.micro_batches == 2 * c.layout.stages)]
        for cand in feasible:
            keras.utils.set_random_seed(0)
            model = tnt.Model(MODELS[name](keras), plan=plan.with_layout(cand.layout))
            model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x[:PLAN_BATCH * WARM_STEPS], y[:PLAN_BATCH * WARM_STEPS], batch_size=PLAN_BATCH, verbose=0)
            pipelined = cand.layout.stages > 1
            if pipelined:
                model.pipeline_stats(reset=True)
            steps: list[float] = []
            model.fit(x[:PLAN_BATCH * TIMED_STEPS], y[:PLAN_BATCH * TIMED_STEPS], batch_size=PLAN_BATCH,
                      verbose=0, callbacks=[benchlib.step_times(keras, steps)])
            per_rank = tnt_comm.allgather_object(steps)
            slowest = [max(k) for k in zip(*per_rank)]  # a step lasts as long as its slowest rank's
            medians = [statistics.median(s) for s in per_rank]
            rec = {"layout": cand.layout.describe(), "partition": cand.layout.partition,
                   "stages": cand.layout.stages, "micro_batches": cand.layout.micro_batches,
                   "remat": cand.layout.remat, "split_after": cand.layout.split_after,
                   "predicted_step_s": cand.estimate.step_s, "predicted_compute_s": cand.estimate.compute_s,
                   "measured_step_s": statistics.median(slowest), "per_rank_step_s": medians}
            if pipelined:
                busy = _stage_busy(model, tnt_comm)
                rec["stage_busy_s"] = [statistics.median(b) for b in busy]
                rec["stage_balance"] = statistics.median(max(k) / min(k) for k in zip(*busy) if min(k) > 0)
            rec["samples_per_s"] = PLAN_BATCH / rec["measured_step_s"]
            layouts.append(rec)
            if rank == 0:
                print(f"{name} {rec['layout']:36} predicted {rec['predicted_step_s'] * 1e3:7.1f} ms, measured "
                      f"{rec['measured_step_s'] * 1e3:7.1f} ms" + (f", stage balance {rec['stage_balance']:.2f}"
                                                                  if pipelined else ""), flush=True)
            del model
        result[name] = {"chosen": plan.layout.describe(), "plan_seconds": plan_s, "layouts": layouts,
                        "summary": plan.summary(print_fn=None)}
    if rank == 0:
        Path(out).write_text(json.dumps(result, indent=1, default=float))


def plantime_worker(out: str) -> None:
    """Seconds of ``tnt.plan_parallel`` in a fresh process (its probes included) for 8 ranks,
    global batch 64: a 100-block MLP (Dense(64) x 100 + a head: 101 layers) and the same
    depth with every width different (no two layers alike: each one timed)."""
    import keras

    import tarantella as tnt

    def mlp_of(widths: list[int]) -> keras.Model:
        inp = keras.Input((64,))
        x = inp
        for i, w in enumerate(widths):
            x = keras.layers.Dense(w, activation="relu", name=f"d{i}")(x)
        return keras.Model(inp, keras.layers.Dense(10, name="head")(x))

    res = {}
    for name, widths in (("blocks", [64] * 100), ("distinct", [32 + i for i in range(100)])):
        model = mlp_of(widths)
        t0 = time.perf_counter()
        plan = tnt.plan_parallel(model, num_ranks=8, global_batch_size=64, memory_budget=None)
        res[name] = {"seconds": time.perf_counter() - t0, "layers": len(model.layers) - 1,
                     "chosen": plan.layout.describe(), "layouts": len(plan.feasible) + len(plan.rejected)}
        print(f"plan time {name}: {res[name]['seconds']:.1f} s for {res[name]['layers']} layers, "
              f"{res[name]['layouts']} layouts", flush=True)
    Path(out).write_text(json.dumps(res))


def plantime_rows(res: dict) -> list[dict]:
    if not res:
        return []
    b, d = res["blocks"], res["distinct"]
    return [{"name": "auto_plan_seconds_100_blocks_8ranks", "value": b["seconds"], "target": 10.0,
             "higher_is_better": False, "unit": "s, tnt.plan_parallel in a fresh process (probes included)",
             "detail": f"MLP of 100 x Dense(64) + head ({b['layers']} layers), 8 ranks, global batch 64, "
                       f"{b['layouts']} layouts, chose {b['chosen']}; beside it 100 Dense layers of 100 "
                       f"different widths (each timed; the probes already measured by then): {d['seconds']:.1f} s (auto.py)"}]


# -- the driver -------------------------------------------------------------------------------
def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _launch(ranks: int, args: list[str], timeout: float = 1500) -> None:
    cmd = [benchlib.mpirun(), "--oversubscribe", "--bind-to", "none", "-n", str(ranks), sys.executable,
           str(Path(__file__).resolve()), *args]
    subprocess.run(cmd, env=_env(), check=True, timeout=timeout)


def run_memory(names: list[str], tmp: Path) -> dict[str, list[dict]]:
    res = {}
    for name in names:
        ranks = MEMORY_LAYOUTS[name][0]
        t0 = time.perf_counter()
        _launch(ranks, ["--worker", "memory", name, "--out", str(tmp / name)])
        res[name] = [json.loads(Path(f"{tmp / name}.{r}.json").read_text()) for r in range(ranks)]
        top = max(res[name], key=lambda r: r["peak_bytes"])
        print(f"memory {name}: {top['layout']} predicted {top['predicted_bytes'] / 2**20:.0f} MiB, measured "
              + ", ".join(f"{r['peak_bytes'] / 2**20:.0f}" for r in res[name])
              + f" MiB  [{time.perf_counter() - t0:.0f} s]", flush=True)
    return res


def memory_rows(res: dict[str, list[dict]]) -> list[dict]:
    if not res:
        return []
    errs = []
    for name, recs in res.items():
        top = max(recs, key=lambda r: r["peak_bytes"])
        errs.append((top["predicted_bytes"] / top["peak_bytes"] - 1, name, top))
    worst = max(errs, key=lambda e: abs(e[0]))
    mib = 2**20
    return [{"name": "memory_estimate_error", "value": abs(worst[0]), "target": 0.15, "higher_is_better": False,
             "unit": "|plan_parallel's per-rank bytes / measured peak - 1| (largest rank, worst layout)",
             "detail": "; ".join(f"{t['layout']}: {e:+.3f} (predicted {t['predicted_bytes'] / mib:.0f} vs "
                                 f"{t['peak_bytes'] / mib:.0f} MiB)" for e, _, t in errs)
             + f"; {memory_bench.IN}->{memory_bench.WIDTH} MLP of memory.py, Adam, batch "
               f"{memory_bench.GLOBAL_BATCH}, {MEM_STEPS} steps, peak = max RSS - RSS after imports (auto.py)"}]


def plan_rows(res: dict, ranks: int) -> list[dict]:
    rows = []
    ratios, errors = [], []
    for name, r in res.items():
        best = max(r["layouts"], key=lambda x: x["samples_per_s"])
        chosen = next(x for x in r["layouts"] if x["layout"] == r["chosen"])
        ratios.append((chosen["samples_per_s"] / best["samples_per_s"], name, chosen, best))
        errors += [(x["predicted_step_s"] / x["measured_step_s"] - 1, name, x["layout"]) for x in r["layouts"]]
    worst = min(ratios, key=lambda t: t[0])
    rows.append({"name": f"auto_plan_vs_best_measured_{ranks}ranks", "value": worst[0], "target": 0.90,
                 "higher_is_better": True, "unit": "x best measured layout's samples/s (worst model)",
                 "detail": "; ".join(f"{n}: chose {c['layout']} {c['samples_per_s']:.0f} samples/s, best "
                                     f"{b['layout']} {b['samples_per_s']:.0f} ({v:.2f})" for v, n, c, b in ratios)
                 + f"; global batch {PLAN_BATCH} (auto.py)"})
    worst_e = max(errors, key=lambda e: abs(e[0]))
    within = sum(abs(e) <= 0.20 for e, _, _ in errors)
    rows.append({"name": f"auto_step_time_error_max_{ranks}ranks", "value": abs(worst_e[0]), "target": 0.20,
                 "higher_is_better": False, "unit": "|predicted / measured step - 1| (worst layout of 3 models)",
                 "detail": f"{within} of {len(errors)} layouts within 20 %; worst {worst_e[1]} {worst_e[2]} "
                           f"{worst_e[0]:+.2f}; per model median |error| "
                 + ", ".join(f"{n} {statistics.median(abs(e) for e, m, _ in errors if m == n):.2f}" for n in res)
                 + " (auto.py)"})
    cnn_r = res.get("cnn")
    if cnn_r:
        for p in sorted({x["stages"] for x in cnn_r["layouts"] if x["stages"] > 1}):
            def pick(part, p=p):
                return next((x for x in cnn_r["layouts"] if x["stages"] == p and x["partition"] == part
                             and not x["remat"] and x["micro_batches"] == 2 * p), None)
            t, b = pick("time"), pick("bytes")
            if b is None:
                continue
            def say(x):
                return (f"{x['partition']} cut after {list(x['split_after'] or [])}: stage compute "
                        + ", ".join(f"{s * 1e3:.1f}" for s in x["stage_busy_s"]) + f" ms/step, max/min "
                        f"{x['stage_balance']:.2f}")
            rows.append({"name": f"pipeline_stage_time_balance_p{p}", "value": t and t["stage_balance"],
                         "target": 1.10, "higher_is_better": False,
                         "unit": "max / min of the stages' measured compute per step (median over steps)",
                         "detail": (say(t) if t else "the time-balanced cut is the bytes-balanced one")
                         + f"; beside it {say(b)}; CNN, m = {2 * p}, {ranks} ranks (auto.py)"})
    return rows


def all_rows(result: dict) -> list[dict]:
    """Every row the parts in ``result`` give (memory, and the plan rows of each rank count)."""
    rows = memory_rows(result.get("memory") or {}) + plantime_rows(result.get("plantime") or {})
    for key in sorted(k for k in result if k.startswith("plan_")):
        rows += plan_rows(result[key]["models"], int(key.split("_")[1]))
    return rows


def main(argv: list[str]) -> int:
    if "--worker" in argv:
        kind = argv[argv.index("--worker") + 1]
        out = argv[argv.index("--out") + 1]
        if kind == "memory":
            memory_worker(argv[argv.index("--worker") + 2], out)
        elif kind == "plantime":
            plantime_worker(out)
        else:
            plan_worker(argv[argv.index("--worker") + 2].split(","), out, "--quick" in argv)
        return 0
    ranks = [int(r) for r in (argv[argv.index("--ranks") + 1] if "--ranks" in argv else "2").split(",")]
    only = set(argv[argv.index("--only") + 1].split(",")) if "--only" in argv else {"memory", "plan", "plantime"}
    quick = "--quick" in argv
    models = argv[argv.index("--models") + 1].split(",") if "--models" in argv else list(MODELS)
    stem = "auto" if ranks == [2] else "auto_" + "_".join(map(str, ranks))
    path = RESULTS / f"{stem}.json"  # auto.json: 2 ranks (run_all.py: auto); auto_2_4.json: --ranks 2,4
    result: dict = {"ranks": ranks, "quick": quick}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "memory" in only:
            names = [n for n, (k, _) in MEMORY_LAYOUTS.items() if k in ranks]
            if quick:
                names = [n for n in names if n in ("dp2", "pp2", "tp2")]
            result["memory_machine"] = benchlib.machine()
            result["memory"] = run_memory(names, tmp)
        if "plantime" in only:
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "plantime", "--out",
                            str(tmp / "plantime.json")], env=_env(), check=True, timeout=1200)
            result["plantime"] = json.loads((tmp / "plantime.json").read_text())
        if "plan" in only:
            for n in ranks:
                t0 = time.perf_counter()
                machine = benchlib.machine()
                extra = ["--quick"] if quick else []
                _launch(n, ["--worker", "plan", ",".join(models), "--out", str(tmp / f"plan{n}.json"), *extra],
                        timeout=3600)
                res = json.loads((tmp / f"plan{n}.json").read_text())
                result[f"plan_{n}"] = {"models": res, "seconds": time.perf_counter() - t0,
                                       "machine_before": machine, "machine_after": benchlib.machine()}
    if "--only" in argv and path.exists():  # refresh this run's parts, keep the others (read now:
        result = {**json.loads(path.read_text()), **result}  # another --only run may have written)
    result["rows"] = all_rows(result)
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=float) + "\n")
    rows = result["rows"]
    print(f"\n{'row':>40} {'value':>8} {'target':>8}")
    for r in rows:
        v = "-" if r["value"] is None else f"{r['value']:8.3f}"
        print(f"{r['name']:>40} {v:>8} {r['target']:8.3f}  {r['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
