"""Pipelining benchmark (issue 11): bubble, speed-up over plain Keras.

    mpirun -n 2 --bind-to core python benchmarks/pipeline.py [--quick]   (run_all.py: pipeline)

Rows (results/pipeline.json -> summary.json through summary.py):

Memory per stage is measured, not counted, by benchmarks/memory.py (issue 29:
pipeline_peak_memory_largest_stage_p2/_p4); the counted pipeline_memory_per_stage_* rows
are gone.

- pipeline_bubble_error_p2: measured idle fraction minus (p - 1)/(m + p - 1), m in
  {2, 4, 8}, GPipe on a dense stack balanced in time (``stack(stem=True)``); the row is
  the largest |error|; `--only-bubble` runs just these and prints them. A stage's idle
  fraction is 1 - compute time / the pipeline's span of the step (first stage in to last
  stage out, tarantella.pipelining.pipeline_idle_fractions), as the theory counts it; the
  row takes the pipeline's (the mean over its stages, ``pipeline_bubbles``), median over
  the steps. Each stage's own, and its idle on its own clock, are in the JSON beside it.
- pipeline_speedup_p2_m8: samples/s of 2 stages (1F1B, m = 8) / plain Keras on rank 0
  alone, same global batch, one compute thread per rank, paired per round (median).
  Beside it: one process running the same 8 micro-batches (gradient accumulation) and
  data parallelism (tnt.Model DATA) on the same 2 ranks.
"""

from __future__ import annotations

import statistics
import sys
import time

import benchlib  # first: pins TensorFlow's threads
import numpy as np
import tensorflow as tf

benchlib.pin_threads(tf)
import keras  # noqa: E402

import tarantella as tnt  # noqa: E402
import tnt_comm  # noqa: E402
from tarantella.pipelining import pipeline_idle_fractions  # noqa: E402

QUICK = "--quick" in sys.argv
# Micro-batches of B / M = 2048 rows. A 1-thread 512-wide matmul here runs per sample at
# the same speed at 2048 and 4096 rows, but 1.7x slower at 1024 and 512 rows (and 64 rows
# at ~0.4 of 512 rows' speed): measured on this VM (docs/pipelining.md, "Measured"). Smaller
# micro-batches would charge the pipeline for small matrices, not for pipelining; the
# accumulation row (one process, the same micro-batches) shows what they cost.
WIDTH, DEPTH, CLASSES = 512, 8, 10
B, M = 16384, 8
STEPS = 3 if QUICK else 5
ROUNDS = 1 if QUICK else 4
BUBBLE_ROUNDS = 1 if QUICK else 3


@keras.saving.register_keras_serializable(package="tnt_bench")
class Bias(keras.layers.Layer):
    """x + b, b trainable: the cheapest layer whose gradient needs its input's gradient."""

    def build(self, input_shape):
        self.b = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="b")

    def call(self, x):
        return x + self.b


def stack(seed: int = 0, stem: bool = False) -> keras.Model:
    """A dense stack: DEPTH layers of WIDTH x WIDTH, a small classifier.

    ``stem``: the bubble's model must be balanced in time, not only in bytes. The first
    stage never computes the gradient of its input (the data), so with equal layers its
    backward has one matmul fewer than the last stage's (7 against 8 of the 512 x 512
    ones per micro-batch), and the first stage idles more than the theory says (measured
    before: m = 2 idle 0.416 / 0.316 against 0.333). A trainable bias in front of d0
    needs d0's input gradient: each stage then runs the same four layers (4 forward,
    8 backward matmuls), plus one elementwise add and a column sum on the first, and the
    classifier and loss on the last, both small. Tried before: an input 1.5 x WIDTH wide
    balanced the matmul count but not the time (its matmuls ran slower per flop); PReLU
    (a dozen elementwise passes forward and backward) made stage 0 20 % slower at m = 2,
    where a micro-batch's 16 MiB activations no longer fit the 4 MiB L2 cache.
    """
    keras.utils.set_random_seed(seed)
    x = inp = keras.Input((WIDTH,), name="x")
    if stem:
        x = Bias(name="stem")(x)
    for k in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="relu", name=f"d{k}")(x)
    return keras.Model(inp, keras.layers.Dense(CLASSES, activation="softmax", name="out")(x), name="stack")


def dataset(steps: int) -> tf.data.Dataset:
    """``steps`` global batches, tf.data autotuning off.

    With autotuning on, deleting the iterator at the end of every ``fit`` waits for
    tf.data's autotune thread to wake up from its sleep (measured: 0.8-4.6 s, growing with
    the length of the fit, in plain Keras and tnt alike; seen in gdb as
    ``RootDataset::Iterator::~Iterator`` waiting on ``Model::OptimizeLoop``). That fixed
    cost per fit call is no part of a training step and would swamp a 5-step timing.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B * 2, WIDTH)).astype("float32")
    y = rng.integers(0, CLASSES, B * 2).astype("int32")
    options = tf.data.Options()
    options.autotune.enabled = False
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(B).repeat().take(steps).with_options(options)


def timed_fit(model, steps: int) -> float:
    model.fit(dataset(2), epochs=1, verbose=0)  # warm-up: traces
    tnt_comm.barrier()
    t0 = time.perf_counter()
    model.fit(dataset(steps), epochs=1, verbose=0)
    return time.perf_counter() - t0


def keras_alone(steps: int) -> float | None:
    """Plain Keras on rank 0 while rank 1 waits: samples/s."""
    result = None
    if tnt.get_rank() == 0:
        model = stack()
        model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
        result = steps * B / timed_fit_local(model, steps)
    tnt_comm.barrier()
    return tnt_comm.broadcast_object(result, 0)


def timed_fit_local(model, steps: int) -> float:
    model.fit(dataset(2), epochs=1, verbose=0)
    t0 = time.perf_counter()
    model.fit(dataset(steps), epochs=1, verbose=0)
    return time.perf_counter() - t0


def accumulation_alone(steps: int) -> float | None:
    """One process, the same M micro-batches per step, gradients accumulated: samples/s."""
    result = None
    if tnt.get_rank() == 0:
        model = stack()
        opt = keras.optimizers.SGD(0.01)
        loss_fn = keras.losses.SparseCategoricalCrossentropy()
        opt.build(model.trainable_variables)

        @tf.function(reduce_retracing=True)
        def grads_of(x, y, w):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True)) * w
            return tape.gradient(loss, model.trainable_variables)

        @tf.function
        def apply(grads):
            opt.apply_gradients(zip(grads, model.trainable_variables))

        def step(x, y):
            total = None
            for k in range(M):
                sl = slice(k * B // M, (k + 1) * B // M)
                g = grads_of(x[sl], y[sl], tf.constant(1.0 / M))
                total = g if total is None else [a + b for a, b in zip(total, g)]
            apply(total)

        batches = list(dataset(steps + 2))
        for x, y in batches[:2]:
            step(x, y)
        t0 = time.perf_counter()
        for x, y in batches[2:]:
            step(x, y)
        result = steps * B / (time.perf_counter() - t0)
    tnt_comm.barrier()
    return tnt_comm.broadcast_object(result, 0)


def distributed(steps: int, **options) -> float:
    model = tnt.Model(stack(), **options)
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    seconds = max(tnt_comm.allgather_object(timed_fit(model, steps)))
    return steps * B / seconds


def bubble_model(m: int) -> tnt.Model:
    """The balanced stack on 2 stages, GPipe with m micro-batches, traced and warmed up."""
    model = tnt.Model(stack(stem=True), parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                      num_pipeline_stages=2, num_micro_batches=m, pipeline_schedule="gpipe")
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    model.fit(dataset(2), epochs=1, verbose=0)
    return model


def bubble_once(model: tnt.Model, m: int) -> list[dict]:
    """Every stage's idle fraction over STEPS steps of ``model`` (one row per stage)."""
    model.pipeline_stats(reset=True)
    model.fit(dataset(STEPS), epochs=1, verbose=0)
    stats = tnt_comm.allgather_object(model.pipeline_stats())
    span_idle = pipeline_idle_fractions(stats)
    overhead = schedule_overhead(stats, m)
    windows = [row["windows"] for row in stats]
    for s, (row, idle) in enumerate(zip(stats, span_idle)):
        row["step_idle_fractions"] = [step_idle(windows, s, k) for k in range(len(windows[s]))]
        row["own_clock_idle_fraction"] = row.pop("idle_fraction")
        row["idle_fraction"] = idle  # over the step's span, as the theory counts (pipelining._stats)
        row["theory"] = 1 / (m + 1)
        row["m"] = m
        row["schedule_overhead"] = overhead
        del row["windows"]
    return stats


def step_span(windows: list[list], k: int) -> float:
    """Step ``k``'s span over the stages: first stage in to last stage out."""
    return max(w[k][1] for w in windows) - min(w[k][0] for w in windows)


def step_idle(windows: list[list], stage: int, k: int) -> float:
    """Stage ``stage``'s idle fraction in step ``k``: 1 - its compute / the step's span."""
    return 1.0 - windows[stage][k][2] / step_span(windows, k)


def bubbles(ms: tuple[int, ...] = (2, 4, 8)) -> tuple[list[dict], list[list[dict]]]:
    """Per (m, stage): the median step's idle fraction over BUBBLE_ROUNDS rounds.

    A stage's compute on this VM (a guest sharing its host) drifts by up to ~25 % between
    stretches of a few seconds: the same stage and work took 4.5 s of compute in one m's
    run and 5.8 s in the next, with the machine otherwise idle. In a stretch where one
    stage runs slower the other idles for it, by more than the row's 0.05, and the idle
    summed over a run carries every such stretch. So the row takes the median over the
    steps (each step's idle over its own span), and the rounds measure every m in turn,
    so that a slow stretch of the host falls on a few steps of each m, not on all of one.
    The summed idle (``summed_idle_fraction``, median over rounds) stays in the JSON.
    """
    models = {m: bubble_model(m) for m in ms}
    rounds = [[row for m in ms for row in bubble_once(models[m], m)] for _ in range(BUBBLE_ROUNDS)]
    medians = []
    for k, first in enumerate(rounds[0]):
        row = dict(first)
        for key in ("own_clock_idle_fraction", "busy_seconds", "schedule_seconds", "schedule_overhead"):
            row[key] = statistics.median(r[k][key] for r in rounds)
        row["summed_idle_fraction"] = statistics.median(r[k]["idle_fraction"] for r in rounds)
        row["step_idle_fractions"] = [x for r in rounds for x in r[k]["step_idle_fractions"]]
        row["idle_fraction"] = statistics.median(row["step_idle_fractions"])
        row["rounds"] = len(rounds)
        medians.append(row)
    return medians, rounds


def pipeline_bubbles(stage_rows: list[dict]) -> list[dict]:
    """Per m: the pipeline's idle fraction, the median over steps of the mean over stages.

    The theory's (p-1)/(m+p-1) is every stage's idle on a balanced pipeline, and so the
    idle share of the pipeline's device time: 1 - sum of the stages' compute / (p x span),
    which is the mean of the stages' idle fractions in the step. On this VM a stage runs
    up to ~25 % slower than the other for stretches of seconds; in such a step the faster
    stage idles for the slower one. The faster stage's idle moves by ~m^2/(m+1)^2 of that
    imbalance (0.44 at m = 2: a 10 % slower partner adds 0.044), the mean over the stages
    by a quarter of it at m = 2 and about half at m = 8 - and by the same amount whichever
    stage is the slow one. Each stage's own median stays in the JSON and the row's detail.
    """
    out = []
    for m in sorted({r["m"] for r in stage_rows}):
        stages = sorted((r for r in stage_rows if r["m"] == m), key=lambda r: r["stage"])
        per_step = [statistics.fmean(xs) for xs in zip(*(r["step_idle_fractions"] for r in stages))]
        out.append({"m": m, "theory": stages[0]["theory"], "idle_fraction": statistics.median(per_step),
                    "stage_idle_fractions": [r["idle_fraction"] for r in stages],
                    "schedule_overhead": stages[0]["schedule_overhead"], "steps": len(per_step)})
    return out


def schedule_overhead(stage_stats: list[dict], m: int) -> float:
    """1 - ideal span / measured span over the steps, the ideal from the measured compute.

    The theory's (p-1)/(m+p-1) assumes equal stages, but on this VM a stage's compute
    varies by +-15 % from step to step, so in any one step one stage is the slower and the
    other idles for it: that moves the measured idle by more than the row's 0.05. Given
    each stage's measured compute c_s per micro-batch in a step, a schedule without
    overheads spans sum_s c_s + (m - 1) max_s c_s (fill, steady state at the slowest
    stage, drain); what the measured span exceeds that by is the executor's own cost
    (transfers, copies, Python) - the part of the bubble the implementation controls.
    """
    windows = [s["windows"] for s in stage_stats]
    measured = ideal = 0.0
    for k in range(len(windows[0])):
        per_mb = [w[k][2] / m for w in windows]
        ideal += sum(per_mb) + (m - 1) * max(per_mb)
        measured += step_span(windows, k)
    return 1.0 - ideal / measured


def main() -> int:
    if tnt.get_size() != 2:
        raise SystemExit("run on 2 ranks: mpirun -n 2 python benchmarks/pipeline.py")
    before = benchlib.machine()
    if "--only-bubble" in sys.argv:  # for working on the schedule: prints, writes nothing
        for b in pipeline_bubbles(bubbles()[0]):
            if tnt.is_master_rank():
                print(f"m={b['m']}: pipeline idle {b['idle_fraction']:.3f} vs {b['theory']:.3f} (stages "
                      + " / ".join(f"{x:.3f}" for x in b["stage_idle_fractions"])
                      + f"), schedule overhead {b['schedule_overhead']:.3f}", flush=True)
        return 0

    rounds = []
    def pipelined() -> float:
        return distributed(STEPS, parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                           num_pipeline_stages=2, num_micro_batches=M, pipeline_schedule="1f1b")

    for r in range(ROUNDS):
        # The speed-up's two runs are timed next to each other, in alternating order: the
        # host's speed drifts by up to ~25 % over tens of seconds, and a ratio of runs a
        # minute apart (another contender between them) measured the drift (1.05 in a round
        # of a run whose others gave 1.58 and 1.41).
        accum = accumulation_alone(STEPS)
        if r % 2 == 0:
            alone, piped = keras_alone(STEPS), pipelined()
        else:
            piped, alone = pipelined(), keras_alone(STEPS)
        data_parallel = distributed(STEPS)
        rounds.append({"keras_alone": alone, "accumulation_alone": accum, "pipeline_p2_m8": piped,
                       "data_parallel_2": data_parallel})
        if tnt.is_master_rank():
            print(f"round {r}: samples/s keras {alone:.0f}, accumulation {accum:.0f}, "
                  f"pipeline p=2 m=8 {piped:.0f}, data parallel {data_parallel:.0f}", flush=True)
    bubble_rows, bubble_rounds = bubbles()

    def median(key, ref):
        return statistics.median(r[key] / r[ref] for r in rounds)

    speedup = median("pipeline_p2_m8", "keras_alone")
    result = {
        "ranks": 2, "quick": QUICK, "width": WIDTH, "depth": DEPTH, "global_batch": B, "micro_batches": M,
        "steps": STEPS, "rounds": rounds, "bubbles": bubble_rows, "bubble_rounds": bubble_rounds,
        "machine_before": before,
    }
    pipeline_idle = pipeline_bubbles(bubble_rows)
    result["pipeline_bubbles"] = pipeline_idle
    bubble_errors = [b["idle_fraction"] - b["theory"] for b in pipeline_idle]
    result["rows"] = [
        {"name": "pipeline_bubble_error_p2", "value": max(abs(e) for e in bubble_errors), "target": 0.05,
         "higher_is_better": False, "unit": "|pipeline idle fraction - (p-1)/(m+p-1)|",
         "detail": "; ".join(f"m={b['m']}: pipeline idle {b['idle_fraction']:.3f} vs {b['theory']:.3f}"
                             for b in pipeline_idle) + "; per stage: "
                   + "; ".join(f"m={b['m']} stage {b['stage']}: idle {b['idle_fraction']:.3f}"
                               f" (summed {b['summed_idle_fraction']:.3f}, own clock {b['own_clock_idle_fraction']:.3f}, busy {b['busy_seconds']:.2f} s)"
                               for b in bubble_rows) + f"; median step of {BUBBLE_ROUNDS} rounds x {STEPS} steps; bias stem; schedule overhead over the "
                             "ideal span of the measured compute: " + ", ".join(
                                 f"m={b['m']} {b['schedule_overhead']:.3f}" for b in bubble_rows if b["stage"] == 0)
                   + " (pipeline.py)"},
        {"name": "pipeline_speedup_p2_m8", "value": speedup, "target": 0.85 * 2 * M / (M + 1),
         "higher_is_better": True, "unit": "x plain Keras samples/s (1 rank)",
         "detail": f"per-round ratios {[round(r['pipeline_p2_m8'] / r['keras_alone'], 3) for r in rounds]}; "
                   f"accumulation alone {median('accumulation_alone', 'keras_alone'):.3f}x Keras, "
                   f"pipeline vs accumulation {median('pipeline_p2_m8', 'accumulation_alone'):.3f}x, "
                   f"data parallel 2 ranks {median('data_parallel_2', 'keras_alone'):.3f}x Keras (pipeline.py)"},
    ]
    if tnt.is_master_rank():
        benchlib.RESULTS.mkdir(exist_ok=True)
        import json

        (benchlib.RESULTS / "pipeline.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
        print(f"\n{'row':>32} {'value':>8} {'target':>8}")
        for row in result["rows"]:
            print(f"{row['name']:>32} {row['value']:8.3f} {row['target']:8.3f}  {row['detail']}")
    tnt_comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
