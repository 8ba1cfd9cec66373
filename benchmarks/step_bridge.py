"""Host cost of the graph bridge per bucket, and overlap with and without jit_compile.

    mpirun -n 2 python benchmarks/step_bridge.py [--quick]

1. ``step_host_overhead_per_bucket_us``: an MLP of 16 Dense(32) layers (33 gradient and
   metric tensors, tiny compute) trained by ``tnt.Model`` with ``TNT_FUSION_THRESHOLD=0``
   (one bucket per tensor) and with a threshold that puts everything in one bucket,
   timed round-robin in the same job. (step time with B buckets - step time with 1) /
   (B - 1) is what one more bucket costs a training step: its submit op, its slice of the
   wait op, the split, and its collective's share not hidden by the others in flight. With
   the native ops (the row) and with the ``tf.numpy_function`` fallback (GIL, array
   conversion; traced under ``tnt.native.disabled()``), all four models in one job.
2. jit: ResNet-20 trained by ``tnt.Model`` (64 KB fusion threshold, so that there are
   buckets to overlap) with ``jit_compile=False`` and ``True``,
   round-robin: samples/s of each and ``overlap_fraction`` = the share of buckets
   submitted earlier than the step's last submit by at least 5 % of the step (with jit
   the part before the exchange is one XLA cluster, so every bucket is submitted, back to
   back, when backprop has ended), and the spread of the submits over the step. Speeds
   with the native ops (and the fallback's beside them); the submit times come from the
   fallback models, whose submits pass through Python (same graph, same buckets).

The engine's submits are timed by wrapping the public ``tnt_comm.FusedAllreduce`` (as
training.py does), which only the fallback calls from Python: the bucket count and the jit
part use it. Rank 0 prints a table and writes
benchmarks/results/step_bridge.json.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import time
from pathlib import Path

import benchlib as bl  # first: pins threads before TensorFlow starts
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

bl.pin_threads(tf)

HERE = Path(__file__).parent
JIT_THRESHOLD_KB = 64  # ResNet-20's 1.09 MB of gradients in ~17 buckets
EARLY_SHARE = 0.05  # submitted this share of the step before the last submit: overlapped


class SubmitClock:
    """perf_counter() of every submit since the last reset, and of every wait."""

    submits: list[float] = []
    waits: list[float] = []

    @classmethod
    def reset(cls) -> None:
        cls.submits, cls.waits = [], []


class TimedEngine(tnt_comm.FusedAllreduce):
    def submit_many(self, indices, arrays) -> None:
        SubmitClock.submits.append(time.perf_counter())
        super().submit_many(indices, arrays)

    def wait_buckets(self):
        SubmitClock.waits.append(time.perf_counter())
        return super().wait_buckets()


tnt_comm.FusedAllreduce = TimedEngine  # tnt-keras looks it up when building a reducer


def mlp(depth: int = 16, width: int = 32) -> keras.Model:
    layers = [keras.Input((width,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth - 1)]
    layers += [keras.layers.Dense(bl.CLASSES)]
    return keras.Sequential(layers)


def epoch_seconds(model, ds, epochs: int) -> list[float]:
    timer = bl.EpochTimer.make(keras)
    model.fit(ds, epochs=epochs, verbose=0, callbacks=[timer])
    return timer.seconds


def bridge(quick: bool) -> dict:
    """Per-bucket step cost with the native ops and with the tf.numpy_function fallback
    (traced under tnt.native.disabled()), all four models timed round-robin."""
    steps, rounds = (40, 3) if quick else (100, 5)
    rng = np.random.default_rng(0)
    n = tnt.get_size()
    x = rng.standard_normal((8 * n * steps, 32), dtype=np.float32)
    y = rng.integers(0, bl.CLASSES, len(x)).astype(np.int32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8 * n)
    weights = mlp().get_weights()
    models, buckets = {}, {}
    for ops, name in itertools.product(("fallback", "native"), ("one_bucket", "bucket_per_tensor")):
        kb = 1 << 20 if name == "one_bucket" else 0
        os.environ["TNT_FUSION_THRESHOLD"] = str(kb)
        m = tnt.Model(mlp())
        os.environ.pop("TNT_FUSION_THRESHOLD")
        m.set_weights(weights)
        m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        SubmitClock.reset()
        with tnt.native.disabled() if ops == "fallback" else contextlib.nullcontext():
            m.fit(ds.take(2), epochs=1, verbose=0)  # warm-up: traces the step, builds the reducer
        if ops == "fallback":  # the Python submits are only seen here; same plan natively
            buckets[name] = len(SubmitClock.submits) // 2
        models[(ops, name)] = m
    per_round = {k: [] for k in models}
    for _ in range(rounds):
        for key, m in models.items():
            tnt_comm.barrier()
            per_round[key].append(bl.median(epoch_seconds(m, ds, 1)) / steps)
    extra = buckets["bucket_per_tensor"] - buckets["one_bucket"]
    out = {"buckets": buckets, "native_ops": tnt.native.in_use(), "native_why_not": tnt.native.why_not,
           "step_s": {f"{o}/{b}": bl.median(v) for (o, b), v in per_round.items()},
           "step_s_per_round": {f"{o}/{b}": v for (o, b), v in per_round.items()}}
    for ops in ("native", "fallback"):
        per_bucket = [(b - a) / extra for a, b in zip(per_round[(ops, "one_bucket")],
                                                      per_round[(ops, "bucket_per_tensor")])]
        suffix = "" if ops == "native" else "_fallback"
        out[f"step_host_overhead_per_bucket_us{suffix}"] = bl.median(per_bucket) * 1e6
    return out


def overlap(quick: bool) -> dict:
    cfg = bl.MODELS["resnet"]
    steps = max(4, cfg["steps"] // (2 if quick else 1))
    rounds = 2 if quick else 4
    n = tnt.get_size()
    ds = bl.dataset(tf, "resnet", cfg["micro_batch"] * n, steps)
    weights = bl.build(keras, "resnet").get_weights()
    models = {}
    for ops, jit in itertools.product(("native", "fallback"), (False, True)):
        os.environ["TNT_FUSION_THRESHOLD"] = str(JIT_THRESHOLD_KB)  # several buckets to overlap
        m = tnt.Model(bl.build(keras, "resnet"))
        os.environ.pop("TNT_FUSION_THRESHOLD")
        m.set_weights(weights)
        m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=jit)
        with tnt.native.disabled() if ops == "fallback" else contextlib.nullcontext():
            m.fit(ds.take(2), epochs=1, verbose=0)  # warm-up (traces and compiles)
        models[f"{ops}/jit_{str(jit).lower()}"] = m
    sps = {k: [] for k in models}
    fractions = {k: [] for k in models}
    spreads = {k: [] for k in models}
    for _ in range(rounds):
        for name, m in models.items():
            tnt_comm.barrier()
            SubmitClock.reset()
            seconds = epoch_seconds(m, ds, 1)
            sps[name].append(cfg["micro_batch"] * n * steps / seconds[0])
            # split the submits into steps at each wait (one wait per step); only the
            # fallback's submits pass through Python, where SubmitClock sees them
            submits, waits = SubmitClock.submits, SubmitClock.waits
            start = 0
            for prev, w in itertools.pairwise(waits):  # whole steps only: between two waits
                step = [s for s in submits[start:] if prev < s <= w]
                start = submits.index(step[-1]) + 1 if step else start
                if step:
                    last, period = max(step), w - prev
                    fractions[name].append(sum(s < last - EARLY_SHARE * period for s in step) / len(step))
                    spreads[name].append((last - min(step)) / period)
    out = {}
    for jit in ("jit_false", "jit_true"):
        fb = f"fallback/{jit}"
        out[jit] = {
            "samples_per_s": bl.median(sps[f"native/{jit}"]),
            "samples_per_s_fallback": bl.median(sps[fb]),
            "overlap_fraction": float(np.mean(fractions[fb])),
            "submit_spread_share_of_step": bl.median(spreads[fb]),
        }
    out["jit_over_nojit_speed"] = out["jit_true"]["samples_per_s"] / out["jit_false"]["samples_per_s"]
    return out


def rows(result: dict) -> list[dict]:
    """summary.py's rows (it reads them from this JSON)."""
    load = result["machine_before"]["loadavg"][0]
    out = []
    if "bridge" in result:
        b = result["bridge"]
        st = b["step_s"]
        out.append({"name": "step_host_overhead_per_bucket_us", "value": b["step_host_overhead_per_bucket_us"],
                    "target": 30.0, "higher_is_better": False, "unit": "us per bucket per step",
                    "detail": f"native ops{'' if b['native_ops'] else ' NOT in use: ' + str(b['native_why_not'])}: "
                              f"MLP step {st['native/one_bucket'] * 1e3:.2f} ms with "
                              f"{b['buckets']['one_bucket']} bucket, {st['native/bucket_per_tensor'] * 1e3:.2f} "
                              f"ms with {b['buckets']['bucket_per_tensor']}; tf.numpy_function fallback in the same "
                              f"job: {st['fallback/one_bucket'] * 1e3:.2f} / {st['fallback/bucket_per_tensor'] * 1e3:.2f}"
                              f" ms, {b['step_host_overhead_per_bucket_us_fallback']:.1f} us per bucket "
                              f"(step_bridge.py, load {load:.1f})"})
    if "jit" in result:
        j = result["jit"]
        out.append({"name": "overlap_fraction_jit", "value": j["jit_true"]["overlap_fraction"], "target": None,
                    "higher_is_better": True, "unit": "share of buckets submitted before backprop ends",
                    "detail": f"ResNet-20, 2 ranks: jit {j['jit_true']['samples_per_s']:.1f} samples/s vs no jit "
                              f"{j['jit_false']['samples_per_s']:.1f} (overlap without jit "
                              f"{j['jit_false']['overlap_fraction']:.2f}; step_bridge.py)"})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=("bridge", "jit"), default=None)
    p.add_argument("--out", type=Path, default=HERE / "results" / "step_bridge.json")
    args = p.parse_args()
    result = {"ranks": tnt.get_size(), "machine_before": bl.machine()}
    if args.only in (None, "bridge"):
        result["bridge"] = bridge(args.quick)
    if args.only in (None, "jit"):
        result["jit"] = overlap(args.quick)
    result["machine_after"] = bl.machine()
    result["rows"] = rows(result)
    if tnt.get_rank() != 0:
        return
    load = result["machine_before"]["loadavg"][0]
    print(f"\ngraph bridge on {result['ranks']} ranks (load {load:.2f} -> "
          f"{result['machine_after']['loadavg'][0]:.2f})")
    if "bridge" in result:
        b = result["bridge"]
        for ops, suffix in (("native", ""), ("fallback", "_fallback")):
            print(f"  MLP step, {ops} ops: {b['step_s'][ops + '/one_bucket'] * 1e3:.2f} ms with "
                  f"{b['buckets']['one_bucket']} bucket(s), {b['step_s'][ops + '/bucket_per_tensor'] * 1e3:.2f} ms "
                  f"with {b['buckets']['bucket_per_tensor']}: step_host_overhead_per_bucket_us = "
                  f"{b['step_host_overhead_per_bucket_us' + suffix]:.1f}")
    if "jit" in result:
        j = result["jit"]
        for name in ("jit_false", "jit_true"):
            print(f"  ResNet-20 {name}: {j[name]['samples_per_s']:.1f} samples/s (fallback ops "
                  f"{j[name]['samples_per_s_fallback']:.1f}), overlap_fraction "
                  f"{j[name]['overlap_fraction']:.2f}, submits spread over "
                  f"{100 * j[name]['submit_spread_share_of_step']:.1f} % of the step")
        print(f"  jit / no jit speed: {j['jit_over_nojit_speed']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
