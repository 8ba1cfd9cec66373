"""The measurement shared by the sharded memory benchmarks (sharded_all.py, sharded_own_step.py):
a Dense stack, one launch per sharding level, and each rank's memory figures.

Each rank reports its measured peak (VmHWM at the end minus VmRSS after the imports, before
the model was built), the peak of the steady steps (VmHWM reset through /proc/self/clear_refs
after a first fit of one step that traced everything, minus the same baseline), the bytes its
weight buffers hold after training (read from the buffers: level 3 frees the non-owned ones
between steps), its Keras optimizer variables' bytes, and TensorFlow's CPU allocator's bytes
in use between steps and its peak over the steady steps
(``tf.config.experimental.get_memory_info``: freed buffers stay in the allocator's pool, so RSS
cannot show what is freed between steps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

WIDTHS = [1024, 2048, 2048, 1024, 10]  # Psi ~ 8.4 M float32 parameters
BATCH = 64


def status(field: str) -> int:
    """A byte figure of /proc/self/status (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def dense_layers(keras) -> list:
    keras.utils.set_random_seed(1)
    return [keras.Input((WIDTHS[0],))] + [keras.layers.Dense(w, name=f"d{i}") for i, w in enumerate(WIDTHS[1:])]


def measured_fit(model, steps: int, before: int) -> dict:
    """Fit one step (traces), then the steady ``steps``; the run's and the steady steps' peaks
    above ``before`` and TensorFlow's allocator figures."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * steps, WIDTHS[0])).astype("float32")
    y = rng.normal(size=(BATCH * steps, WIDTHS[-1])).astype("float32")
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # traces
    first_peak = status("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the steady steps' peak next
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    steady = status("VmHWM") - before
    allocator = tf.config.experimental.get_memory_info("CPU:0")
    return {"peak_bytes": max(first_peak, status("VmHWM")) - before,  # the whole run's (both fits)
            "steady_peak_bytes": steady,
            "tf_between_steps_bytes": int(allocator["current"]),
            "tf_steady_peak_bytes": int(allocator["peak"])}


def held_bytes(optimizer, weights, shards) -> dict:
    """Counted from the buffers: optimizer variables, weights, weights stored between steps."""
    import numpy as np

    whole = int(sum(np.prod(v.shape) * 4 for v in weights))
    return {"optimizer_bytes": int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in optimizer.variables)),
            "weight_bytes": whole,
            "stored_weight_bytes": shards.stored_bytes(weights) if shards is not None else whole}


def report(level: int, mine: dict, out: str) -> None:
    """Every rank's figures, written by the master to ``out``."""
    import tarantella as tnt
    import tnt_comm

    everyone = tnt_comm.allgather_object(mine)
    if tnt.is_master_rank():
        Path(out).write_text(json.dumps({"level": level, "ranks": everyone}))


def launch_levels(script: str, ranks: int, levels: str, steps: int) -> Iterator[dict]:
    """One ``ranks``-rank launch of ``script --worker LEVEL`` per level; yields each level's figures."""
    for level in (int(k) for k in levels.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            subprocess.run(["tarantella", "-n", str(ranks), "--python-interpreter", sys.executable, "--", script,
                            "--worker", str(level), "--steps", str(steps), "--out", out], check=True)
            yield json.loads(Path(out).read_text())


def main(script: str, ranks: int, default_levels: str, worker: Callable[[int, int, str], None],
         line: Callable[[dict], str], order: Callable[[dict], tuple]) -> None:
    """The command line of a sharded memory benchmark: ``--worker`` inside a launch, else one
    launch per level, each level's ranks printed by ``line``."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--levels", default=default_levels)
    parser.add_argument("--worker", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps, args.out)
        return
    for row in launch_levels(script, ranks, args.levels, args.steps):
        print(f"sharding={row['level']}: " + ", ".join(line(r) for r in sorted(row["ranks"], key=order)), flush=True)
