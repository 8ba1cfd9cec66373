"""Communication costs for the planner: the alpha-beta (latency, bandwidth) model of
``benchmarks/stepsim.py`` / ``benchmarks/scaling_model.py`` as a library module.

Defaults are this machine's MPI over shared memory as ``benchmarks/allreduce.py`` and
``benchmarks/fusion.py`` measured it (102 MB allreduced by 2 ranks in 82 ms: about
1.2 GB/s per rank; small messages about 10 us): what ``plan_parallel`` on one process
assumes. Inside a launched job, :func:`measure_network` times the job's own allreduce
(ParallelStrategy.AUTO does before it plans), so the plan prices the cluster it runs on.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass

import numpy as np

#: The two allreduces :func:`measure_network` times: a latency-bound one and a
#: bandwidth-bound one (large enough that alpha is < 1 % of it on shared memory).
SMALL_BYTES, LARGE_BYTES = 8, 8 << 20
#: Chained graph collectives per timed call of the in-step probe (Note [A collective inside a step]).
PROBE_COLLECTIVES = 16
#: Untimed calls first, then timed ones (median) of the in-step probe: 16 allreduces take
#: about 0.3 ms, so the probe costs milliseconds.
PROBE_WARM_UP, PROBE_REPEATS = 4, 9
#: ``Network.collective_s`` on one process (nothing to time): this machine's, 2 ranks otherwise idle (6-33 us).
DEFAULT_COLLECTIVE_S = 20e-6


@dataclass(frozen=True)
class Network:
    """Per-message latency ``alpha_s``, per-rank bandwidth ``beta_Bps`` (bytes/s) and the
    own cost of one collective inside a traced step, ``collective_s`` (Note [A collective
    inside a step])."""

    alpha_s: float = 10e-6
    beta_Bps: float = 1.2e9
    name: str = "this machine (MPI over shared memory, measured by benchmarks/allreduce.py)"
    collective_s: float = DEFAULT_COLLECTIVE_S

    def __post_init__(self) -> None:
        for field, value in (("alpha_s", self.alpha_s), ("beta_Bps", self.beta_Bps),
                             ("collective_s", self.collective_s)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(value) or value < 0:
                raise ValueError(f"tnt.auto.Network({field}=...) takes a finite number >= 0, got {value!r}.")
        if self.beta_Bps == 0:
            raise ValueError("tnt.auto.Network(beta_Bps=...) must be > 0 (bytes per second per rank).")


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


def in_step_allreduces_s(n: int, count: int, nbytes: float, net: Network) -> float:
    """``count`` allreduces inside a step moving ``nbytes`` in all, one after another: each
    pays its latency and its own cost in the step (Note [A collective inside a step])."""
    if n <= 1 or count <= 0:
        return 0.0
    return count * (allreduce_s(n, nbytes / count, net) + net.collective_s)


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
    fastest.append(_in_step_collective_s(repeats))
    small, large, in_step = (max(x) for x in zip(*tnt_comm.allgather_object(fastest)))
    alpha = small / (2 * (n - 1))
    beta = 2 * (n - 1) / n * (LARGE_BYTES - SMALL_BYTES) / max(large - small, 1e-9)
    return Network(alpha_s=alpha, beta_Bps=beta, collective_s=max(0.0, in_step - 2 * (n - 1) * alpha),
                   name=f"measured in this job: allreduce of {SMALL_BYTES} B and {LARGE_BYTES >> 20} MiB over {n} "
                        f"ranks, fastest of {repeats}, slowest rank; a collective in a step: median of "
                        f"{PROBE_COLLECTIVES} chained ones")


def _in_step_collective_s(repeats: int) -> float:
    """Seconds of one 8-byte allreduce run as a graph op inside a traced function, beyond
    the op it replaces (Note [A collective inside a step]); collective: every rank calls it."""
    import tensorflow as tf

    import tnt_comm

    from .._core import graph_collectives

    comm = tnt_comm.world()

    def chained(x):
        for i in range(PROBE_COLLECTIVES):
            x = graph_collectives.allreduce(x, comm, "tnt-auto-probe", f"tnt_auto_probe_{i}") * 0.5
        return x

    def plain(x):
        for _ in range(PROBE_COLLECTIVES):
            x = (x + 0.0) * 0.5
        return x

    x = tf.ones([SMALL_BYTES // 4], tf.float32)
    timed = [tf.function(f, autograph=False) for f in (chained, plain)]
    for _ in range(PROBE_WARM_UP):  # trace, then a process' first calls (slower: up to 300 us seen)
        for f in timed:
            f(x).numpy()
    extra = []
    for _ in range(max(PROBE_REPEATS, repeats)):
        seconds = []
        for f in timed:
            tnt_comm.barrier()
            t0 = time.perf_counter()
            f(x).numpy()
            seconds.append(time.perf_counter() - t0)
        extra.append((seconds[0] - seconds[1]) / PROBE_COLLECTIVES)
    return max(0.0, float(np.median(extra)))
