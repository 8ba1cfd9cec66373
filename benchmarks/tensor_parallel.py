"""Tensor-parallel benchmark (issue 18): host time of one in-graph collective.

    mpirun -n 2 --bind-to core python benchmarks/tensor_parallel.py [--quick]   (run_all.py: tensor_parallel)

Row (results/tensor_parallel.json -> summary.json through summary.py):

- tensor_collective_overhead_us: time per in-graph SUM-allreduce (``reduce_from_group``,
  a ``tf.numpy_function`` op inside a ``tf.function``, K of them chained) minus the time of
  the same ``Communicator.allreduce`` called K times from Python on the same group, same
  bytes (1 KiB, latency-bound): what the graph op adds beyond the MPI call. Median of
  rounds; the allgather's figure is in the detail.

The memory and speed-up rows of the issue (Transformer stack, compute-bound MLP) are not
measured yet.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import benchlib  # first: pins TensorFlow's threads
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

K = 200


def _per_call(fn, reps: int) -> float:
    fn()  # warm-up (tracing)
    times = []
    for _ in range(reps):
        tnt_comm.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) / K)
    return statistics.median(times)


def main() -> int:
    quick = "--quick" in sys.argv
    benchlib.pin_threads(tf)
    reps = 5 if quick else 15
    group = tnt.tensor_parallel.TensorGroup.of_world(tnt.get_size())
    x = np.ones(256, np.float32)  # 1 KiB
    xt = tf.constant(x)

    def direct():
        a = x
        for _ in range(K):
            a = group.comm.allreduce(a, tnt_comm.Op.SUM) * np.float32(0.5)

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

    mpi = _per_call(direct, reps)
    graph = _per_call(lambda: in_graph(xt).numpy(), reps)
    gather = _per_call(lambda: gathered(xt).numpy(), reps)
    direct_gather = _per_call(lambda: [group.comm.allgather(x[:128]) for _ in range(K)], reps)
    overhead = (graph - mpi) * 1e6
    result = {"ranks": tnt.get_size(), "k": K, "reps": reps, "direct_allreduce_us": mpi * 1e6,
              "in_graph_allreduce_us": graph * 1e6, "direct_allgather_us": direct_gather * 1e6,
              "in_graph_allgather_us": gather * 1e6}
    result["rows"] = [
        {"name": "tensor_collective_overhead_us", "value": overhead, "target": 30.0,
         "higher_is_better": False, "unit": "us per in-graph collective beyond the MPI call",
         "detail": f"allreduce 1 KiB: in graph {graph * 1e6:.1f} us vs direct {mpi * 1e6:.1f} us; allgather "
                   f"in graph {gather * 1e6:.1f} us vs direct {direct_gather * 1e6:.1f} us "
                   f"(t={tnt.get_size()}, K={K} chained, median of {reps}) (tensor_parallel.py)"},
    ]
    if tnt.is_master_rank():
        benchlib.RESULTS.mkdir(exist_ok=True)
        (benchlib.RESULTS / "tensor_parallel.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
        for row in result["rows"]:
            print(f"{row['name']:>32} {row['value']:8.2f} {row['target']:8.2f}  {row['detail']}")
    tnt_comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
