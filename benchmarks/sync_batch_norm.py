"""Cost of synchronised batch normalisation: ResNet-20 with and without it, N ranks.

    tarantella -n 2 -- benchmarks/sync_batch_norm.py [--rounds R] [--epochs E]

Two ``tnt.Model`` contenders on the same model, data and threads, timed round-robin
(after a warm-up epoch each): ``local`` (Keras' BatchNormalization, micro-batch
statistics) and ``sync`` (``sync_batch_norm=True``: global-batch statistics, two in-graph
allreduces per layer forward and two backward). Reports the median over rounds of the
per-round step-time ratio sync / local and writes results/sync_batch_norm_<N>.json.
(``training.py scaling`` carries the same contender, ``tnt_syncbn``, beside the others.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import benchlib as bl  # first: pins threads before TensorFlow starts
import keras
import tensorflow as tf

import tarantella as tnt

bl.pin_threads(tf)


class EpochClock(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._t = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="2 rounds of 1 epoch")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.epochs = 2, 1
    n, name = tnt.get_size(), "resnet"
    cfg = bl.MODELS[name]
    steps = cfg["steps"]
    ds = bl.dataset(tf, name, cfg["micro_batch"] * n, steps)
    weights = bl.build(keras, name).get_weights()
    models = {}
    for kind in ("local", "sync"):
        model = tnt.Model(bl.build(keras, name), sync_batch_norm=kind == "sync")
        model.set_weights(weights)
        bl.compile_model(model)
        model.fit(ds, epochs=1, verbose=0)  # warm-up: tracing
        models[kind] = model
    per_round = {k: [] for k in models}
    for _ in range(args.rounds):
        for kind, model in models.items():
            clock = EpochClock()
            model.fit(ds, epochs=args.epochs, verbose=0, callbacks=[clock])
            per_round[kind].append(bl.median(clock.seconds) / steps)
    ratios = [s / loc for s, loc in zip(per_round["sync"], per_round["local"])]
    res = {"ranks": n, "model": name, "micro_batch": cfg["micro_batch"], "steps": steps,
           "step_s": {k: bl.median(v) for k, v in per_round.items()},
           "step_s_per_round": per_round, "sync_over_local": bl.median(ratios),
           "sync_over_local_per_round": ratios, "machine": bl.machine()}
    if tnt.is_master_rank():
        print(f"{'contender':10} {'step ms':>9}")
        for k, v in res["step_s"].items():
            print(f"{k:10} {v * 1e3:9.1f}")
        print(f"sync / local step time (median of per-round ratios): {res['sync_over_local']:.3f}")
        out = Path(__file__).parent / "results" / f"sync_batch_norm_{n}.json"
        out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
