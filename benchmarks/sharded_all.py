"""Sharding on ALL's replica axis (docs/sharding.md, "ALL"): per-rank optimizer state and
measured peak of 2 pipeline stages x 2 replicas at sharding 0, 1, 2 and 3.

    python benchmarks/sharded_all.py [--steps 3] [--levels 0,1,2,3]   # one 4-rank launch per level

Each rank reports the bytes of its stage's Keras optimizer variables (counted: at levels
1-3 only the owned variables' slots), its measured peak (VmHWM at the end minus VmRSS
after the imports, before the model was built), the peak of the steady steps (VmHWM reset
through /proc/self/clear_refs after a first fit of one step that traced everything, minus
the same baseline) and the bytes its stage's weight buffers hold after training (read from
the buffers: level 3 frees the non-owned ones between steps), and TensorFlow's CPU
allocator's bytes in use between steps and its peak over the steady steps
(``tf.config.experimental.get_memory_info``: freed buffers stay in the allocator's pool,
so RSS cannot show what is freed between steps). The model: a Dense stack
(Psi ~ 8.4 M float32 parameters), Adam, cut into 2 stages.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WIDTHS = [1024, 2048, 2048, 1024, 10]
BATCH = 64


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(level: int, steps: int, out: str) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import tarantella as tnt
    import tnt_comm

    before = _status("VmRSS")
    keras.utils.set_random_seed(1)
    layers = [keras.Input((WIDTHS[0],))] + [keras.layers.Dense(w, name=f"d{i}") for i, w in enumerate(WIDTHS[1:])]
    model = tnt.Model(keras.Sequential(layers), parallel_strategy=tnt.ParallelStrategy.ALL,
                      num_pipeline_stages=2, num_micro_batches=2, sharding=level)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * steps, WIDTHS[0])).astype("float32")
    y = rng.normal(size=(BATCH * steps, WIDTHS[-1])).astype("float32")
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # traces
    first_peak = _status("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the steady steps' peak next
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    steady = _status("VmHWM") - before
    # TensorFlow's CPU allocator: the bytes it hands out now (between steps: what RSS cannot
    # show, as freed buffers stay in the allocator's pool) and at most during the steady steps.
    allocator = tf.config.experimental.get_memory_info("CPU:0")
    optimizer = model._tnt_stage.optimizer
    shards = model._tnt_stage.shards
    weights = model.stage_model.trainable_variables
    mine = {
        "stage": model.stage, "replica": model.replica,
        "optimizer_bytes": int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in optimizer.variables)),
        "weight_bytes": int(sum(np.prod(v.shape) * 4 for v in weights)),
        "stored_weight_bytes": shards.stored_bytes(weights) if shards is not None else
        int(sum(np.prod(v.shape) * 4 for v in weights)),
        "peak_bytes": max(first_peak, _status("VmHWM")) - before,  # the whole run's (both fits)
        "steady_peak_bytes": steady,
        "tf_between_steps_bytes": int(allocator["current"]),
        "tf_steady_peak_bytes": int(allocator["peak"]),
    }
    everyone = tnt_comm.allgather_object(mine)
    if tnt.is_master_rank():
        Path(out).write_text(json.dumps({"level": level, "ranks": everyone}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--levels", default="0,1,2,3")
    parser.add_argument("--worker", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps, args.out)
        return
    rows = []
    for level in (int(k) for k in args.levels.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            subprocess.run(["tarantella", "-n", "4", "--python-interpreter", sys.executable, "--", __file__,
                            "--worker", str(level), "--steps", str(args.steps), "--out", out], check=True)
            rows.append(json.loads(Path(out).read_text()))
        row = rows[-1]  # printed as each level ends
        ranks = sorted(row["ranks"], key=lambda r: (r["stage"], r["replica"]))
        print(f"sharding={row['level']}: " + ", ".join(
            f"s{r['stage']}r{r['replica']} optimizer {r['optimizer_bytes'] / 1e6:.1f} MB peak {r['peak_bytes'] / 1e6:.0f} MB"
            f" (steady {r['steady_peak_bytes'] / 1e6:.0f} MB) weights stored {r['stored_weight_bytes'] / 1e6:.1f} MB"
            f" TF allocator between steps {r['tf_between_steps_bytes'] / 1e6:.1f} MB,"
            f" steady peak {r['tf_steady_peak_bytes'] / 1e6:.1f} MB"
            for r in ranks), flush=True)


if __name__ == "__main__":
    main()
