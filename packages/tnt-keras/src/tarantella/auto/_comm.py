"""Communication costs for the planner: the alpha-beta (latency, bandwidth) model of
``benchmarks/stepsim.py`` / ``benchmarks/scaling_model.py`` as a library module.

Defaults are this machine's MPI over shared memory as ``benchmarks/allreduce.py`` and
``benchmarks/fusion.py`` measured it (102 MB allreduced by 2 ranks in 82 ms: about
1.2 GB/s per rank; small messages about 10 us). Pass a :class:`Network` measured
elsewhere to plan for other hardware.
"""

from __future__ import annotations

from dataclasses import dataclass


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
