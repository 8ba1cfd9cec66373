"""Where a sharded step's memory peak stands, by phase (docs/sharding.md, "Memory and speed").

Run one rank per process (mpirun prints every rank's line; tnt's launcher rank 0's)::

    TF_ENABLE_ONEDNN_OPTS=0 mpirun -n 2 python benchmarks/sharded_phases.py [--level 2]

Trains benchmarks/sharded.py's 92 M-parameter MLP (``--large``) with Adam; a thread samples
the RSS every 2 ms, and a wrapper around the replicas' communicator times each
``reduce_scatter`` and ``allgather``. Per timed step, each rank prints the peak RSS above the
RSS at the step's start in: backprop and the reduce-scatters (until the last one ended), the
update (until the first allgather of values began), the allgathers, and the rest. Why a probe
and not VmHWM alone: VmHWM says how high, not during which part of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import benchlib as bl  # pins threads before TensorFlow
from sharded import MICRO_BATCH, WIDTHS_LARGE

MiB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Timed:
    """The communicator, with its reduce-scatters and allgathers timed (start, end)."""

    def __init__(self, comm, events: list) -> None:
        self._comm, self._events = comm, events

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def reduce_scatter(self, buf, counts):
        self._events.append((time.perf_counter(), "rs0"))
        out = self._comm.reduce_scatter(buf, counts)
        self._events.append((time.perf_counter(), "rs1"))
        return out

    def allgather(self, a):
        self._events.append((time.perf_counter(), "ag0"))
        out = self._comm.allgather(a)
        self._events.append((time.perf_counter(), "ag1"))
        return out


def _phases(events: list, samples: list) -> list[dict]:
    """Per step: each phase's peak RSS above the step's start (MiB) and its length (s)."""
    out = []
    starts = [i for i, e in enumerate(events) if e[1] == "step"]
    for k, si in enumerate(starts):
        ei = next(i for i in range(si, len(events)) if events[i][1] == "end")
        ev = events[si:ei + 1]
        t0 = ev[0][0]
        base = next(r for t, r in samples if t >= t0)
        rs_end = max((t for t, n in ev if n == "rs1"), default=t0)
        ag_start = min((t for t, n in ev if n == "ag0"), default=rs_end)
        ag_end = max((t for t, n in ev if n == "ag1"), default=ag_start)
        row: dict = {"step": k}
        for name, a, b in (("backprop_and_scatters", t0, rs_end), ("update", rs_end, ag_start),
                           ("allgathers", ag_start, ag_end), ("rest", ag_end, ev[-1][0])):
            vals = [r for t, r in samples if a <= t <= b]
            row[name] = [round((max(vals) - base) / MiB, 1) if vals else None, round(b - a, 2)]
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--level", type=int, default=2, help="sharding level (1 or 2)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--trace", type=Path, default=None,
                        help="also write each rank's RSS samples and collective events to TRACE.<rank>.json "
                             "(benchmarks/plot_phases.py draws them)")
    args = parser.parse_args()
    import keras
    import numpy as np
    import tensorflow as tf

    import tarantella as tnt

    bl.pin_threads(tf)
    rss_before = _rss()
    widths = WIDTHS_LARGE
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((widths[0],))]
                             + [keras.layers.Dense(w, activation="relu") for w in widths[1:-1]]
                             + [keras.layers.Dense(widths[-1])])
    tm = tnt.Model(model, sharding=args.level)
    tm.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    events: list = []
    samples: list = []
    sharding = tm._tnt_sharding
    sharding.comm = _Timed(sharding.comm, events)  # before the first trace captures it
    batch = MICRO_BATCH * tnt.get_size()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(batch * args.steps, widths[0])).astype("float32")
    y = rng.integers(0, widths[-1], size=batch * args.steps)

    class Marks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            events.append((time.perf_counter(), "step"))

        def on_train_batch_end(self, batch, logs=None):
            events.append((time.perf_counter(), "end"))

    tm.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, epochs=1, verbose=0, shuffle=False)  # traces
    events.clear()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter(), _rss()))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tm.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[Marks()])
    stop.set()
    sampler.join()
    hwm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    print(json.dumps({"rank": tnt.get_rank(), "level": args.level,
                      "peak_MiB": round((hwm - rss_before) / MiB, 1),
                      "phases_MiB_s": _phases(events, samples)}), flush=True)
    if args.trace is not None:
        _write_trace(args.trace, tnt.get_rank(), args.level, events, samples)


def _write_trace(path: Path, rank: int, level: int, events: list, samples: list) -> None:
    """Seconds from the first timed step's start; RSS in MiB above the RSS then."""
    t0 = next(t for t, n in events if n == "step")
    base = next(r for t, r in samples if t >= t0)
    Path(f"{path}.{rank}.json").write_text(json.dumps({
        "rank": rank, "level": level,
        "samples": [[round(t - t0, 4), round((r - base) / MiB, 1)] for t, r in samples if t >= t0],
        "events": [[round(t - t0, 4), n] for t, n in events if t >= t0]}))


if __name__ == "__main__":
    main()
