"""Communication costs for the planner: the alpha-beta (latency, bandwidth) model of
``benchmarks/stepsim.py`` / ``benchmarks/scaling_model.py`` as a library module.

Defaults are this machine's MPI over shared memory as ``benchmarks/allreduce.py`` and
``benchmarks/fusion.py`` measured it (102 MB allreduced by 2 ranks in 82 ms: about
1.2 GB/s per rank; small messages about 10 us): what ``plan_parallel`` on one process
assumes. Inside a launched job, :func:`measure_network` times the job's own allreduce
(ParallelStrategy.AUTO does before it plans), so the plan prices the cluster it runs on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

#: The two allreduces :func:`measure_network` times: a latency-bound one and a
#: bandwidth-bound one (large enough that alpha is < 1 % of it on shared memory).
SMALL_BYTES, LARGE_BYTES = 8, 8 << 20


@dataclass(frozen=True)
class Network:
    """Per-message latency ``alpha_s`` and per-rank bandwidth ``beta_Bps`` (bytes/s)."""

    alpha_s: float = 10e-6
    beta_Bps: float = 1.2e9
    name: str = "this machine (MPI over shared memory, measured by benchmarks/allreduce.py)"


def allreduce_s(n: int, nbytes: float, net: Network) -> float:
    """Ring allreduce: 2(n-1) alpha + 2(n-1)/n bytes / beta."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * net.alpha_s + 2 * (n - 1) / n * nbytes / net.beta_Bps


def allgather_s(n: int, nbytes: float, net: Network) -> float:
    """Ring allgather of ``nbytes`` in all (as reduce-scatter): (n-1) alpha + (n-1)/n bytes / beta."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * net.alpha_s + (n - 1) / n * nbytes / net.beta_Bps


def p2p_s(nbytes: float, net: Network) -> float:
    """One point-to-point message."""
    return net.alpha_s + nbytes / net.beta_Bps if nbytes > 0 else 0.0


def measure_network(repeats: int = 5) -> Network:
    """alpha and beta of this job's allreduce, measured now on every rank (collective:
    every rank calls it). Each size is timed ``repeats`` times after one warm-up, between
    barriers; the fastest of them counts (the network, not what else the machine runs), on
    the slowest rank. alpha from the small allreduce (its ``2(n-1)`` latencies), beta from
    what the large one takes beyond it."""
    import tnt_comm

    n = tnt_comm.size()
    if n <= 1:
        return Network(name="one rank: nothing to communicate (defaults)")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"measure_network(repeats=...) takes a positive integer, got {repeats!r}.")
    fastest = []
    for nbytes in (SMALL_BYTES, LARGE_BYTES):
        buf = np.ones(nbytes // 4, dtype=np.float32)
        tnt_comm.allreduce(buf)  # warm-up: first-use set-up is not the network
        seconds = []
        for _ in range(repeats):
            tnt_comm.barrier()
            t0 = time.perf_counter()
            tnt_comm.allreduce(buf)
            seconds.append(time.perf_counter() - t0)
        fastest.append(min(seconds))
    small, large = (max(x) for x in zip(*tnt_comm.allgather_object(fastest)))
    alpha = small / (2 * (n - 1))
    beta = 2 * (n - 1) / n * (LARGE_BYTES - SMALL_BYTES) / max(large - small, 1e-9)
    return Network(alpha_s=alpha, beta_Bps=beta,
                   name=f"measured in this job: allreduce of {SMALL_BYTES} B and {LARGE_BYTES >> 20} MiB over {n} "
                        f"ranks, fastest of {repeats}, slowest rank")
