"""Tensor-parallel benchmark (issue 18): speed-up, host time per collective.

    mpirun -n 2 --bind-to core python benchmarks/tensor_parallel.py [--quick]   (run_all.py: tensor_parallel)

Rows (results/tensor_parallel.json -> summary.json through summary.py):

Memory per rank is measured, not counted, by benchmarks/memory.py (issue 29:
tensor_peak_memory_per_rank_t2); the counted tensor_memory_per_rank_* rows are gone.

- tensor_speedup_t2: samples/s of a compute-bound MLP stack (2 blocks of Dense 2048 ->
  8192 -> 2048, relu) on 2 ranks (TENSOR, t = 2, one compute thread each, pinned) / plain
  Keras on rank 0 alone, same global batch (paired per round, median). Beside it: data
  parallelism and pipelining (2 stages) on the same model and ranks.
- tensor_collective_overhead_us: time per in-graph SUM-allreduce (``reduce_from_group``,
  a native op inside a ``tf.function``, K of them chained, each followed by a multiply
  by 0.5) minus the time per plain ``MPI_Allreduce`` of the same bytes (1 KiB,
  latency-bound; mpi4py's ``Comm.Allreduce``, K in a row) on a communicator of the same
  ranks (``MPI.COMM_WORLD.Split`` with the group's colour and key), in the same job:
  what tarantella adds (graph op, tnt_comm's checks and progress) beyond the MPI call.
  Each figure is the median over rounds; the value is None when mpi4py is missing (nox
  -s bench installs it). Beside it in the detail: tnt_comm's own
  ``Communicator.allreduce`` from Python (the baseline this row subtracted before issue
  28, which hid tnt_comm's own checks and progress), the allgather's figures, and both
  collectives with the ``tf.numpy_function`` fallback (``tnt.native.disabled()``),
  measured in the same job.
"""

from __future__ import annotations

import json
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

QUICK = "--quick" in sys.argv
K = 200
CLASSES = 8
# The compute-bound MLP stack (speed-up row): 2 x (2048 -> 8192 -> 2048).
HIDDEN, WIDE, MLP_BLOCKS, MLP_BATCH = 2048, 8192, 2, 128


# -- speed-up --------------------------------------------------------------------------------
def mlp(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = h = keras.Input((HIDDEN,), name="x")
    for b in range(MLP_BLOCKS):
        f = keras.layers.Dense(WIDE, activation="relu", name=f"up{b}")(h)
        h = keras.layers.Dense(HIDDEN, activation="relu", name=f"down{b}")(f)
    return keras.Model(x, keras.layers.Dense(CLASSES, activation="softmax", name="head")(h), name="mlp")


def mlp_data(steps: int):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(MLP_BATCH * steps, HIDDEN)).astype("float32")
    y = rng.integers(0, CLASSES, MLP_BATCH * steps).astype("int32")
    return x, y


def samples_per_s(model, steps: int) -> float:
    x, y = mlp_data(steps)
    model.fit(x[:MLP_BATCH * 2], y[:MLP_BATCH * 2], batch_size=MLP_BATCH, epochs=1, verbose=0, shuffle=False)
    tnt_comm.barrier()
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=MLP_BATCH, epochs=1, verbose=0, shuffle=False)
    return steps * MLP_BATCH / (time.perf_counter() - t0)


def keras_alone(steps: int) -> float:
    """Plain Keras on rank 0 while the other ranks wait: samples/s."""
    result = None
    if tnt.get_rank() == 0:
        model = mlp()
        model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
        x, y = mlp_data(steps)
        model.fit(x[:MLP_BATCH * 2], y[:MLP_BATCH * 2], batch_size=MLP_BATCH, epochs=1, verbose=0, shuffle=False)
        t0 = time.perf_counter()
        model.fit(x, y, batch_size=MLP_BATCH, epochs=1, verbose=0, shuffle=False)
        result = steps * MLP_BATCH / (time.perf_counter() - t0)
    tnt_comm.barrier()
    return tnt_comm.broadcast_object(result, 0)


def speedups(steps: int, rounds: int) -> dict:
    n = tnt.get_size()
    contenders = {
        "tensor": tnt.Model(mlp(), parallel_strategy=tnt.ParallelStrategy.TENSOR, tensor_parallel_size=n),
        "tensor_jit": tnt.Model(mlp(), parallel_strategy=tnt.ParallelStrategy.TENSOR, tensor_parallel_size=n),
        "data": tnt.Model(mlp()),
        "pipeline": tnt.Model(mlp(), parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                              num_pipeline_stages=n, num_micro_batches=4),
    }
    for key, m in contenders.items():  # tensor_jit: XLA compiles the segments between collectives
        m.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy", jit_compile=key == "tensor_jit")
    ratios: dict[str, list[float]] = {k: [] for k in contenders}
    serial = []
    for _ in range(rounds):
        base = keras_alone(steps)
        serial.append(base)
        for key, m in contenders.items():
            ratios[key].append(samples_per_s(m, steps) / base)
    return {"keras_samples_per_s": serial, "ratios": ratios,
            "median": {k: statistics.median(v) for k, v in ratios.items()}}


# -- host time per collective ----------------------------------------------------------------
def _per_call(fn, reps: int) -> float:
    fn()  # warm-up (tracing)
    times = []
    for _ in range(reps):
        tnt_comm.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) / K)
    return statistics.median(times)


def plain_mpi_allreduce(t: int):
    """``fn()`` calling plain MPI_Allreduce (mpi4py) K times on 1 KiB over a communicator
    of the tensor group's ranks (split as ``TensorGroup.of_world`` splits), or (None, why)."""
    try:
        import mpi4py
    except ImportError as err:
        return None, f"mpi4py not installed ({err})"
    mpi4py.rc.initialize = False  # tnt_comm initialised MPI (TensorGroup.of_world did)
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    comm = world.Split(world.rank // t, world.rank)
    src = np.ones(256, np.float32)
    dst = np.empty_like(src)

    def fn():
        for _ in range(K):
            comm.Allreduce(src, dst, op=MPI.SUM)

    return fn, f"{MPI.Get_library_version().splitlines()[0].split(',')[0]}, mpi4py {mpi4py.__version__}"


def collective_overhead(reps: int) -> dict:
    """Per call: plain MPI_Allreduce (mpi4py), tnt_comm's allreduce from Python, and in
    graph with the native ops and with the tf.numpy_function fallback (traced under
    tnt.native.disabled()), side by side in the same job."""
    group = tnt.tensor_parallel.TensorGroup.of_world(tnt.get_size())
    x = np.ones(256, np.float32)  # 1 KiB
    xt = tf.constant(x)
    plain, plain_what = plain_mpi_allreduce(group.size)

    def direct():
        a = x
        for _ in range(K):
            a = group.comm.allreduce(a, tnt_comm.Op.SUM) * np.float32(0.5)

    def chains():
        @tf.function(jit_compile=False)
        def in_graph(t):
            for _ in range(K):
                t = tnt.tensor_parallel.reduce_from_group(t, group) * 0.5
            return t

        @tf.function(jit_compile=False)
        def gathered(t):
            for _ in range(K):
                t = tnt.tensor_parallel.gather_last_axis(t[: 256 // group.size], group)
            return t

        in_graph.get_concrete_function(xt)  # traced here: inside or outside disabled()
        gathered.get_concrete_function(xt)
        return in_graph, gathered

    native_ar, native_ag = chains()
    with tnt.native.disabled():
        fallback_ar, fallback_ag = chains()
    return {"native_ops": tnt.native.in_use(), "native_why_not": tnt.native.why_not,
            "plain_mpi_allreduce_us": _per_call(plain, reps) * 1e6 if plain else None,
            "plain_mpi": plain_what,
            "direct_allreduce_us": _per_call(direct, reps) * 1e6,
            "in_graph_allreduce_us": _per_call(lambda: native_ar(xt).numpy(), reps) * 1e6,
            "in_graph_allgather_us": _per_call(lambda: native_ag(xt).numpy(), reps) * 1e6,
            "fallback_allreduce_us": _per_call(lambda: fallback_ar(xt).numpy(), reps) * 1e6,
            "fallback_allgather_us": _per_call(lambda: fallback_ag(xt).numpy(), reps) * 1e6,
            "direct_allgather_us": _per_call(lambda: [group.comm.allgather(x[:128]) for _ in range(K)], reps) * 1e6}


# -- rows ------------------------------------------------------------------------------------
def main() -> int:
    n = tnt.get_size()
    result: dict = {"ranks": n, "machine": benchlib.machine()}
    rows: list[dict] = []
    reps = 5 if QUICK else 15
    co = collective_overhead(reps)
    sp = speedups(steps=2 if QUICK else 4, rounds=1 if QUICK else 3)
    result.update(collectives=co, speedup=sp)
    plain = co["plain_mpi_allreduce_us"]
    overhead = co["in_graph_allreduce_us"] - plain if plain is not None else None
    med = sp["median"]
    rows += [
        {"name": "tensor_speedup_t2", "value": med["tensor"], "target": 1.7, "higher_is_better": True,
         "unit": "samples/s on 2 ranks (TENSOR) / plain Keras on 1 rank",
         "detail": (f"MLP {MLP_BLOCKS} x ({HIDDEN}->{WIDE}->{HIDDEN}), global batch {MLP_BATCH}, SGD; "
                    f"same ranks: TENSOR with jit_compile=True {med['tensor_jit']:.2f}x, "
                    f"data parallelism {med['data']:.2f}x, pipelining (2 stages, m=4) "
                    f"{med['pipeline']:.2f}x; plain Keras {statistics.median(sp['keras_samples_per_s']):.0f} "
                    f"samples/s; load {result['machine']['loadavg'][0]:.1f} (tensor_parallel.py)")},
        {"name": "tensor_collective_overhead_us", "value": overhead, "target": 30.0,
         "higher_is_better": False, "unit": "us per in-graph allreduce beyond a plain MPI_Allreduce",
         "detail": (f"allreduce 1 KiB: in graph {co['in_graph_allreduce_us']:.1f} us vs plain MPI_Allreduce "
                    + (f"{plain:.1f} us ({co['plain_mpi']})" if plain is not None
                       else f"not measured: {co['plain_mpi']}")
                    + f" on a communicator of the same {n} ranks; tnt_comm's Communicator.allreduce from "
                    f"Python {co['direct_allreduce_us']:.1f} us (in graph - it: "
                    f"{co['in_graph_allreduce_us'] - co['direct_allreduce_us']:.1f} us); "
                    f"allgather in graph {co['in_graph_allgather_us']:.1f} "
                    f"us vs tnt_comm's from Python {co['direct_allgather_us']:.1f} us; "
                    f"{'native ops' if co['native_ops'] else 'native ops NOT in use: ' + str(co['native_why_not'])}; "
                    f"the tf.numpy_function fallback: allreduce {co['fallback_allreduce_us']:.1f} us, allgather "
                    f"{co['fallback_allgather_us']:.1f} us (t={n}, K={K} chained, median of "
                    f"{reps}) (tensor_parallel.py)")},
    ]
    result["rows"] = rows
    if tnt.is_master_rank():
        benchlib.RESULTS.mkdir(exist_ok=True)
        name = "tensor_parallel.json"
        (benchlib.RESULTS / name).write_text(json.dumps(result, indent=1, default=float) + "\n")
        for row in rows:
            value = "    None" if row["value"] is None else f"{row['value']:8.3f}"
            print(f"{row['name']:>32} {value} {row['target']:8.2f}  {row['detail']}")
    tnt_comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
