"""Measured memory against the plan's estimate, 2 ranks (issue 29; docs/memory.md).

One MLP with ~235 MB of training state (Dense 1024 -> 2048, 3 x Dense 2048, Dense 10;
14.7 M parameters; Adam: weights + gradients + 2 slots) trains one short epoch under
TENSOR (t = 2), PIPELINING (p = 2) and DATA, in that order (increasing per-rank share),
each built under ``tnt.deferred_variables()`` where the strategy allows. Where the kernel lets a process reset its peak RSS
(``/proc/self/clear_refs``), each strategy starts after Python's and glibc's free memory was
returned and the peak reset, and its peak is measured from the RSS at its start; else the
peak since the imports stands (an upper bound: a check on it can fail for a strategy that
overshoots, never pass one that does). Recorded per strategy and rank:
the estimate by category (``model.memory_report()``), the measured peak, and serial
Keras' state bytes, counted here (not by the code under test). Then ``memory_budget=``:
a budget below the estimate must raise MemoryBudgetError on every rank (and before any
step: the weights stay as built), a generous one must not.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource

import _job
import keras
import numpy as np

import tarantella as tnt
import tnt_comm

IN, WIDTH, DEPTH, CLASSES, BATCH, STEPS = 1024, 2048, 3, 10, 32, 2


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


BASELINE = rss()


def start_phase() -> tuple[int, bool]:
    """Free what earlier strategies left (Python garbage, glibc's free heap pages), then
    reset the kernel's peak RSS (VmHWM) where it lets us: (RSS now, whether reset)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return rss(), True
    except OSError:
        return BASELINE, False


def phase_peak(start: int, reset: bool) -> int:
    """Peak RSS since ``start_phase`` minus the RSS then (without a reset: the process' peak
    minus the RSS after imports, an upper bound)."""
    if not reset:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - BASELINE
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    return hwm - start


def mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((IN,))
    x = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    for _ in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def serial_state_bytes() -> int:
    """Weights + gradients + Adam's 2 slots of the serial model, from its shapes alone."""
    params = IN * WIDTH + WIDTH + DEPTH * (WIDTH * WIDTH + WIDTH) + WIDTH * CLASSES + CLASSES
    return 4 * params * 4  # float32; x4: weights, gradients, first and second moments


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * STEPS, IN), dtype=np.float32)
    return x, rng.integers(0, CLASSES, BATCH * STEPS)


def build(strategy: str, **extra) -> tnt.Model:
    options = {"TENSOR": {"tensor_parallel_size": 2},
               "PIPELINING": {"num_pipeline_stages": 2, "num_micro_batches": 2},
               "DATA": {}}[strategy]
    if strategy == "DATA":
        source = mlp()
    else:
        with tnt.deferred_variables():
            source = mlp()
    model = tnt.Model(source, parallel_strategy=getattr(tnt.ParallelStrategy, strategy), **options, **extra)
    model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def measured(strategy: str) -> dict:
    x, y = data()
    start, reset = start_phase()
    model = build(strategy)
    built = {"rss": rss() - start, "peak": phase_peak(start, reset)}
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    rep = model.memory_report()
    out = {"estimate": rep["estimate"], "estimate_total": rep["total_bytes"],
           "report_peak": rep["measured_peak_bytes"], "peak": phase_peak(start, reset), "hwm_reset": reset,
           "layout": rep["layout"], "built": built, "after_fit_rss": rss() - start}
    del model
    gc.collect()
    return out


def budget_case() -> dict:
    x, y = data()
    model = build("DATA", memory_budget="1MiB")
    before = [np.asarray(w).copy() for w in model.get_weights()]
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        tight = {"raised": False, "message": ""}
    except tnt.MemoryBudgetError as err:
        tight = {"raised": True, "message": str(err)}
    tight["weights_unchanged"] = all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    del model
    roomy = build("PIPELINING", memory_budget="64GiB")
    try:
        roomy.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        generous = {"raised": False, "message": ""}
    except tnt.MemoryBudgetError as err:
        generous = {"raised": True, "message": str(err)}
    bad = {"raised": False, "message": ""}
    try:
        build("DATA", memory_budget="six gigabytes")
    except ValueError as err:
        bad = {"raised": True, "message": str(err)}
    return {"tight": tnt_comm.allgather_object(tight), "generous": tnt_comm.allgather_object(generous),
            "unparsable": tnt_comm.allgather_object(bad)}


def main() -> None:
    out = _job.out_path()
    strategies = {s: tnt_comm.allgather_object(measured(s)) for s in ("TENSOR", "PIPELINING", "DATA")}
    _job.write(out, {"ranks": tnt.get_size(), "serial_state_bytes": serial_state_bytes(),
                     "strategies": strategies, "budget": budget_case()})


if __name__ == "__main__":
    main()
