"""Sharded data parallelism (tnt.Model(sharding=k), docs/sharding.md): memory of model state
and step time against plain data parallelism, on 2 ranks.

    python benchmarks/sharded.py [--quick]        # launches one 2-rank job per level
    python benchmarks/sharded.py --large [--quick] # the same rows on issue 30's 92 M MLP

One ``mpirun -n 2`` job per level k = 0, 1, 2, 3 trains the same MLP (Psi ~ 12.6 M float32
parameters, Adam) on synthetic data. Each rank reports:

- its *accounted* model state: parameters + gradients (all of them at levels 0-1, the owned
  ones at levels 2-3, as ZeRO counts them; at level 3 only the owned parameters) + optimizer
  variables (Keras' own, so only the owned variables' slots at levels >= 1);
- its *measured* peak: VmHWM at the end minus VmRSS before the model was built (TensorFlow's
  transient buffers included, e.g. backprop's full local gradient, which exists at every level);
- the median step time (Keras callback, timed steps after a warm-up epoch).

Rows: shardK_state_memory_vs_dp_2ranks (measured peak / level 0's; target: the ZeRO formula,
16 Psi -> 8 Psi + 8 Psi / d at level 1, 4 Psi + 12 Psi / d at level 2 and 16 Psi / d at level
3, plus 15 %), shardK_step_time_vs_dp_2ranks (target 1.05 at level 2, 1.30 at level 3), and the byte balance of whole-variable
ownership on ResNet-50 and GPT-2 small (max / min bytes per replica; target 1.15), and
reduce_scatter_allgather_vs_allreduce_2ranks: tnt_comm.reduce_scatter + allgather of Psi
float32 against one allreduce of the same bytes.

``--large``: the memory and step-time rows only, on the MLP of benchmarks/memory.py (Dense(2048
-> 4096) + 5 x Dense(4096) + Dense(10), Psi ~ 92 M: the size issue 30 asks for), named
shardK_state_memory_vs_dp_2ranks_92m and shardK_step_time_vs_dp_2ranks_92m (results/sharded_92m.json);
the default rows keep the 12.6 M MLP.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import benchlib as bl  # noqa: E402  (pins threads before TensorFlow)

RANKS = 2
LEVELS = (0, 1, 2, 3)
WIDTHS = [1024, 2048, 2048, 2048, 1024, 10]  # Dense stack: ~12.6 M parameters
#: --large: benchmarks/memory.py's MLP, ~92 M parameters (issue 30's model size).
WIDTHS_LARGE = [2048, *[4096] * 6, 10]
MICRO_BATCH = 32
WIDTHS_PSI = sum(a * b + b for a, b in itertools.pairwise(WIDTHS))  # the MLP's parameters


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(level: int, steps: int, widths: list[int]) -> None:
    """One rank of the job of ``level`` on the MLP of ``widths``."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tarantella as tnt

    bl.pin_threads(tf)
    rss_before = _status("VmRSS")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((widths[0],))]
                             + [keras.layers.Dense(w, activation="relu") for w in widths[1:-1]]
                             + [keras.layers.Dense(widths[-1])])
    tm = tnt.Model(model, sharding=level)
    tm.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = MICRO_BATCH * tnt.get_size()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(batch * steps, widths[0])).astype("float32")
    y = rng.integers(0, widths[-1], size=batch * steps)
    times: list[float] = []

    tm.fit(x[: 2 * batch], y[: 2 * batch], batch_size=batch, epochs=1, verbose=0, shuffle=False)  # warm-up
    times.clear()
    tm.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[bl.step_times(keras, times)])
    psi = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    sharding = getattr(tm, "_tnt_sharding", None)
    owned = model.trainable_variables if sharding is None else sharding.owned_variables()
    grad_bytes = bl.variable_bytes(owned if level >= 2 else model.trainable_variables)
    shards = None if sharding is None else sharding.layers
    stored = [v for v in model.weights if shards is None or not shards.is_released(v)]  # level 3: the owned
    record = {
        "level": level, "rank": tnt.get_rank(), "ranks": tnt.get_size(), "psi": psi,
        "param_bytes": bl.variable_bytes(stored), "grad_bytes": grad_bytes,
        "optimizer_bytes": bl.variable_bytes(model.optimizer.variables),
        "peak_bytes": _status("VmHWM") - rss_before, "step_s": bl.median(times), "steps": len(times),
    }
    bl.emit(record)


def comm_worker(reps: int) -> None:
    """tnt_comm.reduce_scatter + allgather (what level 2 moves per step) against one
    allreduce of the same bytes (level 0), medians over ``reps`` calls of the slowest rank."""
    import numpy as np

    import tnt_comm

    buf = np.random.default_rng(tnt_comm.rank()).normal(size=WIDTHS_PSI).astype(np.float32)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            tnt_comm.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return bl.median([max(t) for t in zip(*tnt_comm.allgather_object(times))])

    allreduce = timed(lambda: tnt_comm.allreduce(buf))
    scatter = timed(lambda: tnt_comm.reduce_scatter(buf))
    both = timed(lambda: tnt_comm.allgather(tnt_comm.reduce_scatter(buf)))
    if tnt_comm.rank() == 0:
        bl.emit({"bytes": buf.nbytes, "allreduce_s": allreduce, "reduce_scatter_s": scatter,
                 "reduce_scatter_allgather_s": both})


def balance(size: int) -> dict[str, float]:
    """max / min bytes per replica of whole-variable ownership, for ResNet-50 and GPT-2 small."""
    import keras
    import numpy as np

    from tarantella.data_parallel import assign_owners

    def ratio(variables, d):
        sizes = [int(np.prod(v.shape)) * 4 for v in variables]
        owners = assign_owners(sizes, d)
        loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(d)]
        return max(loads) / min(loads)

    out = {}
    resnet = keras.applications.ResNet50(weights=None)
    for d in (2, 4):
        out[f"resnet50_{d}"] = ratio(resnet.trainable_variables, d)
    try:
        import keras_hub

        gpt2 = keras_hub.models.GPT2Backbone(vocabulary_size=50257, num_layers=12, num_heads=12,
                                             hidden_dim=768, intermediate_dim=3072, max_sequence_length=1024)
        for d in (2, 4):
            out[f"gpt2_{d}"] = ratio(gpt2.trainable_variables, d)
    except ImportError:
        pass
    return out


def formula(level: int, d: int) -> float:
    """ZeRO's per-rank model state over plain data parallelism (Adam, float32: 16 Psi)."""
    return {0: 16.0, 1: 8 + 8 / d, 2: 4 + 12 / d, 3: 16 / d}[level] / 16.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--large", action="store_true",
                        help="the memory and step-time rows on the ~92 M MLP (rows *_92m)")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)),
                        help="comma-separated levels to run (0 is always run: the rows' reference)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--comm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (4 if args.quick else 10)
    widths = WIDTHS_LARGE if args.large else WIDTHS
    suffix = "_92m" if args.large else ""
    if args.worker is not None:
        worker(args.worker, steps, widths)
        return 0
    if args.comm:
        comm_worker(5 if args.quick else 15)
        return 0
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    runs: dict[int, list[dict]] = {}
    machine = bl.machine()
    levels = sorted({0, *(int(k) for k in args.levels.split(",") if k)})
    for level in levels:
        cmd = [bl.mpirun(), "--oversubscribe", "--bind-to", "none", "-n", str(RANKS), sys.executable,
               str(Path(__file__).resolve()), "--worker", str(level), "--steps", str(steps),
               *(["--large"] if args.large else [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
        runs[level] = sorted(bl.parse_results(proc.stdout), key=lambda r: r["rank"])
    comm, balances = None, {}
    if not args.large:  # model-independent rows: once, with the default model
        cmd = [bl.mpirun(), "--oversubscribe", "--bind-to", "none", "-n", str(RANKS), sys.executable,
               str(Path(__file__).resolve()), "--comm", *(["--quick"] if args.quick else [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
        comm = bl.parse_results(proc.stdout)[0]
        balances = balance(RANKS)
    base = runs[0]
    rows = []
    print(f"sharded data parallelism, {RANKS} ranks, MLP Psi = {base[0]['psi'] / 1e6:.1f} M, Adam")
    print(f"{'level':>5} {'accounted MB/rank':>18} {'peak MB/rank':>13} {'step ms':>8}")
    for level in levels:
        r = runs[level]
        accounted = max(x["param_bytes"] + x["grad_bytes"] + x["optimizer_bytes"] for x in r)
        peak = max(x["peak_bytes"] for x in r)
        step = max(x["step_s"] for x in r)
        print(f"{level:5d} {accounted / 1e6:18.1f} {peak / 1e6:13.1f} {step * 1e3:8.1f}")
        if level == 0:
            continue
        acc0 = max(x["param_bytes"] + x["grad_bytes"] + x["optimizer_bytes"] for x in base)
        peak0 = max(x["peak_bytes"] for x in base)
        f = formula(level, RANKS)
        rows.append(bl_row(f"shard{level}_state_memory_vs_dp_{RANKS}ranks{suffix}", peak / peak0, f * 1.15, False,
                           "x level 0's measured peak per rank",
                           f"measured peak (VmHWM - RSS before the build) {peak / 1e6:.0f} vs {peak0 / 1e6:.0f} MB; "
                           f"accounted state {accounted / 1e6:.0f} vs {acc0 / 1e6:.0f} MB = {accounted / acc0:.3f}; "
                           f"ZeRO formula {f:.3f} (target formula + 15 %)"))
        rows.append(bl_row(f"shard{level}_step_time_vs_dp_{RANKS}ranks{suffix}", step / max(x["step_s"] for x in base),
                           {2: 1.05, 3: 1.30}.get(level), False, "x level 0's step time",
                           f"median step {step * 1e3:.1f} vs {max(x['step_s'] for x in base) * 1e3:.1f} ms "
                           f"(slowest rank, {r[0]['steps']} steps)"))
    if comm is not None:
        rows.append(bl_row(f"reduce_scatter_allgather_vs_allreduce_{RANKS}ranks",
                           comm["reduce_scatter_allgather_s"] / comm["allreduce_s"], 1.05, False,
                           "x tnt_comm.allreduce of the same bytes (time)",
                           f"{comm['bytes'] / 1e6:.0f} MB float32: reduce_scatter + allgather "
                           f"{comm['reduce_scatter_allgather_s'] * 1e3:.1f} ms (reduce_scatter alone "
                           f"{comm['reduce_scatter_s'] * 1e3:.1f} ms) vs allreduce {comm['allreduce_s'] * 1e3:.1f} ms"))
    for name, v in balances.items():
        model, d = name.rsplit("_", 1)
        rows.append(bl_row(f"shard_balance_{model}_{d}ranks", v, 1.15, False, "max / min bytes per replica",
                           f"whole-variable ownership (largest first onto the least loaded), {model}, d = {d}"))
    for row in rows:
        print(f"{row['name']:40} {row['value']:.3f}  (target {row['target']})  {row['detail']}")
    bl.RESULTS.mkdir(exist_ok=True)
    (bl.RESULTS / f"sharded{suffix}.json").write_text(json.dumps(
        {"ranks": RANKS, "runs": runs, "comm": comm, "balance": balances, "machine_before": machine,
         "rows": rows},
        indent=1) + "\n")
    return 0


def bl_row(name, value, target, higher, unit, detail) -> dict:
    return {"name": name, "value": value, "target": target, "higher_is_better": higher, "unit": unit,
            "detail": detail}


if __name__ == "__main__":
    raise SystemExit(main())
