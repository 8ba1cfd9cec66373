"""Two source trees side by side on sharded.py's level-3 row: alternating rounds.

    python benchmarks/sharded_ab.py --a /path/old/src --b /path/new/src [--rounds 4] [--steps 10]

The shared 2-core machine's load changes within minutes, so a before/after pair of
``sharded.py`` runs taken at different times says little. Each round here launches, on 2
ranks, level 0 and level 3 with tree A and with tree B (``PYTHONPATH`` of the tarantella
package's ``src``), in an order that alternates between rounds, and reports per round
and as medians: the step-time ratio of row ``shard3_step_time_vs_dp_2ranks`` (median step
of the slowest rank, level 3 over level 0 of the same round), the per-rank peak as
sharded.py measures it (VmHWM at the end minus VmRSS before the model was built), and
the peak of the timed steps alone (VmHWM reset through ``/proc/self/clear_refs`` after the
warm-up fit, minus the same RSS). The model, batch, warm-up and timing are sharded.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import benchlib as bl  # noqa: E402  (pins threads before TensorFlow)
import sharded  # noqa: E402


def worker(level: int, steps: int) -> None:
    """One rank: sharded.worker's fit, with the peak of the timed steps measured too."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tarantella as tnt

    bl.pin_threads(tf)
    rss_before = sharded._status("VmRSS")
    keras.utils.set_random_seed(0)
    w = sharded.WIDTHS
    model = keras.Sequential([keras.Input((w[0],))] + [keras.layers.Dense(n, activation="relu") for n in w[1:-1]]
                             + [keras.layers.Dense(w[-1])])
    tm = tnt.Model(model, sharding=level)
    tm.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = sharded.MICRO_BATCH * tnt.get_size()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(batch * steps, w[0])).astype("float32")
    y = rng.integers(0, w[-1], size=batch * steps)
    times: list[float] = []
    tm.fit(x[: 2 * batch], y[: 2 * batch], batch_size=batch, epochs=1, verbose=0, shuffle=False)  # warm-up
    hwm_warm = sharded._status("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    tm.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[bl.step_times(keras, times)])
    hwm_steps = sharded._status("VmHWM")
    bl.emit({"level": level, "rank": tnt.get_rank(), "step_s": bl.median(times), "steps": len(times),
             "peak_bytes": max(hwm_warm, hwm_steps) - rss_before, "steps_peak_bytes": hwm_steps - rss_before})


def launch(src: str, level: int, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [bl.mpirun(), "--oversubscribe", "--bind-to", "none", "-n", "2", sys.executable,
           str(Path(__file__).resolve()), "--worker", str(level), "--steps", str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    ranks = bl.parse_results(proc.stdout)
    return {"step_s": max(r["step_s"] for r in ranks), "peak_bytes": max(r["peak_bytes"] for r in ranks),
            "steps_peak_bytes": max(r["steps_peak_bytes"] for r in ranks), "load": os.getloadavg()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", help="tree A: the tarantella package's src (PYTHONPATH)")
    parser.add_argument("--b", help="tree B: the same, of the other version")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps)
        return 0
    rounds = []
    for r in range(args.rounds):
        order = [("A", args.a), ("B", args.b)] if r % 2 == 0 else [("B", args.b), ("A", args.a)]
        got = {"round": r, "level0": launch(args.a, 0, args.steps)}
        for name, src in order:
            got[name] = launch(src, 3, args.steps)
        for name in ("A", "B"):
            got[name]["ratio"] = got[name]["step_s"] / got["level0"]["step_s"]
        rounds.append(got)
        print(f"round {r} ({order[0][0]} first): level 0 {got['level0']['step_s'] * 1e3:.0f} ms; "
              + "; ".join(f"{n}: {got[n]['step_s'] * 1e3:.0f} ms = {got[n]['ratio']:.3f}x, peak "
                          f"{got[n]['peak_bytes'] / 1e6:.1f} MB, steps' peak {got[n]['steps_peak_bytes'] / 1e6:.1f} MB"
                          for n in ("A", "B")) + f" (load {got['A']['load']:.1f})", flush=True)
    for n in ("A", "B"):
        med = {k: statistics.median(g[n][k] for g in rounds) for k in ("ratio", "peak_bytes", "steps_peak_bytes")}
        print(f"{n}: median ratio {med['ratio']:.3f}, peak {med['peak_bytes'] / 1e6:.1f} MB, "
              f"steps' peak {med['steps_peak_bytes'] / 1e6:.1f} MB over {len(rounds)} rounds")
    bl.RESULTS.mkdir(exist_ok=True)
    (bl.RESULTS / "sharded_ab.json").write_text(json.dumps({"a": args.a, "b": args.b, "rounds": rounds,
                                                            "machine": bl.machine(), "at": time.time()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
