"""A model's own ``train_step`` at sharding 0, 2 and 3 (docs/sharding.md, "Own train_step"):
per-rank weights stored between steps and measured memory, DATA on 2 ranks.

    python benchmarks/sharded_own_step.py [--steps 3] [--levels 0,2,3]   # one 2-rank launch per level

Level 3 of an own step gathers the whole weights before each step and frees the non-owned
ones after it, so its in-step peak is level 2's and what it saves lies between steps. Each
rank reports the bytes its weight buffers hold after training (read from the buffers), its
measured peak (VmHWM at the end minus VmRSS after the imports, before the model was built),
the peak of the steady steps (VmHWM reset through /proc/self/clear_refs after a first fit of
one step that traced everything, minus the same baseline), and TensorFlow's CPU allocator's
bytes in use between steps and its peak over the steady steps
(``tf.config.experimental.get_memory_info``: freed buffers stay in the allocator's pool, so
RSS cannot show what is freed between steps). The model: the Dense stack of
benchmarks/sharded_all.py (Psi ~ 8.4 M float32 parameters) with the Keras guide's own step
(tape + ``apply_gradients``), Adam.
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

    class OwnStep(keras.Sequential):
        """The guide's own train_step: its tape over the trainable variables, apply_gradients."""

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    before = _status("VmRSS")
    keras.utils.set_random_seed(1)
    layers = [keras.Input((WIDTHS[0],))] + [keras.layers.Dense(w, name=f"d{i}") for i, w in enumerate(WIDTHS[1:])]
    inner = OwnStep(layers)
    model = tnt.Model(inner, sharding=level)
    model.compile(keras.optimizers.Adam(1e-3))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * steps, WIDTHS[0])).astype("float32")
    y = rng.normal(size=(BATCH * steps, WIDTHS[-1])).astype("float32")
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # traces
    first_peak = _status("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the steady steps' peak next
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    steady = _status("VmHWM") - before
    allocator = tf.config.experimental.get_memory_info("CPU:0")
    weights = inner.trainable_variables
    sharding = model._tnt_sharding
    per_step = None if sharding is None else sharding.per_step
    whole = int(sum(np.prod(v.shape) * 4 for v in weights))
    mine = {
        "rank": tnt.get_rank(),
        "weight_bytes": whole,
        "stored_weight_bytes": per_step.stored_bytes(weights) if per_step is not None else whole,
        "optimizer_bytes": int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                                   for v in inner.optimizer.variables)),
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
    parser.add_argument("--levels", default="0,2,3")
    parser.add_argument("--worker", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps, args.out)
        return
    for level in (int(k) for k in args.levels.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            subprocess.run(["tarantella", "-n", "2", "--python-interpreter", sys.executable, "--", __file__,
                            "--worker", str(level), "--steps", str(args.steps), "--out", out], check=True)
            row = json.loads(Path(out).read_text())
        print(f"sharding={row['level']}: " + ", ".join(
            f"r{r['rank']} weights stored {r['stored_weight_bytes'] / 1e6:.1f} of {r['weight_bytes'] / 1e6:.1f} MB,"
            f" optimizer {r['optimizer_bytes'] / 1e6:.1f} MB, peak {r['peak_bytes'] / 1e6:.0f} MB"
            f" (steady {r['steady_peak_bytes'] / 1e6:.0f} MB), TF allocator between steps"
            f" {r['tf_between_steps_bytes'] / 1e6:.1f} MB, steady peak {r['tf_steady_peak_bytes'] / 1e6:.1f} MB"
            for r in sorted(row["ranks"], key=lambda r: r["rank"])), flush=True)


if __name__ == "__main__":
    main()
