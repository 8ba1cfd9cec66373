"""A model of one data-parallel training step as tnt's engine runs it (issue 15).

Pure Python, no dependencies: imported by ``benchmarks/scaling_model.py`` (which feeds it
numbers measured here and published ones, see ``published.py``) and by
``tests/benchmarks`` (which checks its arithmetic against hand-computed cases).

The step, per rank, on the timeline of one step (seconds from its start):

1. Backprop produces gradient tensors; tensor ``i`` exists at ``Profile.tensors[i].ready_s``
   (tensors are listed in the engine's slot order, which is backprop order in tnt-keras).
2. The fusion plan (``plan_buckets``: the rule of ``tnt_comm.plan_buckets``) groups them
   into buckets. A bucket is submitted when its last tensor exists; the submit costs host
   time (``Engine.per_bucket_s`` + its bytes at ``Engine.copy_Bps``), one submit after
   another, which on a CPU rank runs on the compute thread and delays the rest of
   backprop (``submit_blocks_compute``).
3. Buckets start in plan order (the engine's cursor), at most ``k`` in flight. An
   allreduce costs a latency part (``alpha`` terms) and a bandwidth part (``bytes/beta``
   terms, ``allreduce_parts``); buckets in flight overlap their latency parts, but share
   the link, so bandwidth parts run one after another.
4. The step ends when backprop is done and the last bucket is reduced (plus copying the
   results out, then ``Profile.tail_s``: optimizer, metric merge).

Lockstep jitter: a collective completes only when the slowest rank arrives, so the
compute part of an N-rank step is stretched by the expected maximum of N draws of the
per-step relative deviation (``Jitter.stretch``), drawn from a sample; or, where the
ranks' deviations were measured side by side, by the measured mean of the slowest rank
over the mean of the average rank (``Jitter.lockstep``).

Efficiency (weak scaling, fixed micro-batch) = 1-rank step time / N-rank step time; one
rank runs Keras' own step (no engine), so its time is ``Profile.compute_end_s + tail_s``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

INF = math.inf


# -- network ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Network:
    """Per-message latency ``alpha_s`` and per-rank bandwidth ``beta_Bps`` (bytes/s)."""

    name: str
    alpha_s: float
    beta_Bps: float
    note: str = ""


def ring_s(n: int, nbytes: float, net: Network) -> float:
    """Ring allreduce: 2(n-1) steps of one message of bytes/n each."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * net.alpha_s + 2 * (n - 1) / n * nbytes / net.beta_Bps


def recursive_doubling_s(n: int, nbytes: float, net: Network) -> float:
    """Recursive doubling: ceil(log2 n) exchanges of the whole message (small messages)."""
    if n <= 1:
        return 0.0
    return math.ceil(math.log2(n)) * (net.alpha_s + nbytes / net.beta_Bps)


def halving_doubling_s(n: int, nbytes: float, net: Network) -> float:
    """Rabenseifner (reduce-scatter by recursive halving, allgather by doubling):
    ring's bandwidth term with 2 log2(n) latencies (MPI libraries' large-message choice)."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * net.alpha_s + 2 * (n - 1) / n * nbytes / net.beta_Bps


ALGORITHMS = {"ring": ring_s, "recursive_doubling": recursive_doubling_s,
              "halving_doubling": halving_doubling_s}


def allreduce_s(n: int, nbytes: float, net: Network, algorithms: Sequence[str] = tuple(ALGORITHMS)
                ) -> tuple[float, str]:
    """The cheapest of ``algorithms`` (MPI picks by size; we assume it picks well)."""
    return min((ALGORITHMS[a](n, nbytes, net), a) for a in algorithms)


def allreduce_parts(n: int, nbytes: float, net: Network, algorithms: Sequence[str] = tuple(ALGORITHMS)
                    ) -> tuple[float, float, str]:
    """(latency part, bandwidth part, algorithm) of the cheapest allreduce of ``nbytes``."""
    total, algo = allreduce_s(n, nbytes, net, algorithms)
    latency = ALGORITHMS[algo](n, 0.0, net)
    return latency, total - latency, algo


# -- engine, profile, jitter ----------------------------------------------------------------
@dataclass(frozen=True)
class Engine:
    """The host costs of the fused engine and how it runs buckets.

    ``per_bucket_s``: one submit call + hand-off to the communication thread + its wake-up;
    ``copy_Bps``: copy-in of a bucket's bytes (and copy-out of the result);
    ``k``: buckets in flight (``INF``: as many as MPI takes, tnt-comm's behaviour);
    ``submit_blocks_compute``: the submit runs on the compute thread (a CPU rank) rather
    than beside it (a GPU's copy engine);
    ``cycle_s``: > 0 models Horovod's coordinator instead of a fixed plan: every
    ``cycle_s`` whatever is ready (up to the threshold) is fused and sent, one at a time;
    ``algorithms``: the allreduce algorithms the library may pick from (the cheapest wins).
    """

    threshold_bytes: int = 8 << 20
    k: float = INF
    per_bucket_s: float = 0.0
    copy_Bps: float = INF
    submit_blocks_compute: bool = False
    cycle_s: float = 0.0
    algorithms: tuple[str, ...] = tuple(ALGORITHMS)


@dataclass(frozen=True)
class Grad:
    """One gradient tensor: bytes and when backprop produces it (s from step start)."""

    name: str
    nbytes: int
    ready_s: float


@dataclass(frozen=True)
class Profile:
    """A model's step on one rank: gradients in slot (backprop) order, end of backprop,
    and the work after the reduction (``tail_s``: optimizer, metric merge)."""

    name: str
    grads: tuple[Grad, ...]
    compute_end_s: float
    tail_s: float = 0.0
    note: str = ""

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.grads)

    def scaled(self, factor: float) -> Profile:
        """Every compute time stretched by ``factor`` (a slower or contended rank)."""
        return replace(self, grads=tuple(replace(g, ready_s=g.ready_s * factor) for g in self.grads),
                       compute_end_s=self.compute_end_s * factor, tail_s=self.tail_s * factor)


@dataclass(frozen=True)
class Jitter:
    """Relative per-step deviations of one rank's compute time (e.g. t/median - 1)."""

    sample: tuple[float, ...] = (0.0,)
    #: Measured lockstep stretch for one rank count (``lockstep``), used instead of the
    #: i.i.d. maximum: on a shared machine load hits all ranks at once.
    measured: tuple[int, float] | None = None

    @staticmethod
    def lockstep(rows: Sequence[Sequence[float]]) -> Jitter:
        """From per-rank rows of per-step deviations, aligned by step (rows[r][k]): the
        stretch is mean over steps of the slowest rank / mean over steps of the average
        rank, so deviations that hit every rank together cost nothing."""
        steps = list(zip(*rows))
        slowest = sum(1 + max(s) for s in steps) / len(steps)
        average = sum(1 + sum(s) / len(s) for s in steps) / len(steps)
        flat = tuple(d for row in rows for d in row)
        return Jitter(flat, (len(rows), slowest / average))

    @staticmethod
    def normal(sigma: float, points: int = 2000) -> Jitter:
        """A deterministic stand-in for N(0, sigma): the distribution's quantiles."""
        nd = statistics.NormalDist(0.0, sigma) if sigma > 0 else None
        return Jitter(tuple(nd.inv_cdf((i + 0.5) / points) for i in range(points)) if nd else (0.0,))

    def expected_max(self, n: int) -> float:
        """E[max of n i.i.d. draws] from the sample's empirical distribution (exact)."""
        xs = sorted(self.sample)
        m = len(xs)
        return sum(x * ((i / m) ** n - ((i - 1) / m) ** n) for i, x in enumerate(xs, 1))

    def stretch(self, n: int) -> float:
        """Factor on compute time in lockstep: 1 + E[max of n] - E[one draw] (i.i.d.
        draws), or the measured stretch when n is the rank count it was measured at."""
        if self.measured is not None and self.measured[0] == n:
            return self.measured[1]
        return 1.0 + self.expected_max(n) - self.expected_max(1)


# -- the plan and the step ------------------------------------------------------------------
def plan_buckets(sizes: Sequence[int], threshold_bytes: int) -> list[list[int]]:
    """tnt_comm.plan_buckets for one dtype: fill a bucket in order; a tensor that would
    push it past the threshold starts the next one; threshold 0 = one tensor per bucket."""
    plan: list[list[int]] = []
    open_bytes = 0
    for i, size in enumerate(sizes):
        if plan and open_bytes + size <= threshold_bytes:
            plan[-1].append(i)
            open_bytes += size
        else:
            plan.append([i])
            open_bytes = size
    return plan


@dataclass
class StepResult:
    step_s: float
    compute_end_s: float  # end of backprop (with submit costs and jitter)
    comm_end_s: float  # last bucket reduced and copied out
    exposed_s: float  # communication not hidden behind backprop
    buckets: int
    algorithms: dict[str, int] = field(default_factory=dict)
    launches: list[float] = field(default_factory=list)
    finishes: list[float] = field(default_factory=list)


def _planned_buckets(profile: Profile, engine: Engine) -> tuple[list[tuple[float, int]], float]:
    """(ready time, bytes) of each bucket of the fixed plan, submit costs included, and the
    host time the submits took from backprop (when they block it)."""
    plan = plan_buckets([g.nbytes for g in profile.grads], engine.threshold_bytes)
    out = []
    delay = 0.0  # host time the submits took from backprop so far
    host_free = 0.0  # submits run one after another on one host thread
    for bucket in plan:
        nbytes = sum(profile.grads[i].nbytes for i in bucket)
        ready = max(profile.grads[i].ready_s for i in bucket) + delay
        cost = engine.per_bucket_s + nbytes / engine.copy_Bps
        host_free = max(ready, host_free) + cost
        if engine.submit_blocks_compute:
            delay += cost
        out.append((host_free, nbytes))
    return out, delay


def simulate(profile: Profile, n: int, net: Network, engine: Engine, jitter: Jitter = Jitter()
             ) -> StepResult:
    """The N-rank step time of ``profile`` with ``engine`` on ``net`` (see module doc)."""
    stretch = jitter.stretch(n)
    prof = profile.scaled(stretch)
    if n <= 1:  # Keras' own step: no engine
        end = prof.compute_end_s
        return StepResult(end + prof.tail_s, end, end, 0.0, 0)
    algos: dict[str, int] = {}
    launches: list[float] = []
    finishes: list[float] = []

    def run(ready: float, nbytes: int) -> None:
        lat, bw, algo = allreduce_parts(n, nbytes, net, engine.algorithms)
        algos[algo] = algos.get(algo, 0) + 1
        start = max(ready, launches[-1] if launches else 0.0)
        k = engine.k
        if k != INF and len(finishes) >= k:
            start = max(start, finishes[-int(k)])
        end = start + lat + bw
        if finishes:
            end = max(end, finishes[-1] + bw)  # the link carries one bucket's bytes at a time
        launches.append(start)
        finishes.append(end + nbytes / engine.copy_Bps)  # copy-out of the result

    if engine.cycle_s > 0:
        # Horovod's coordinator: at each cycle tick with the link free, fuse what is ready.
        delay = 0.0
        engine = replace(engine, k=1)
        buckets: list[tuple[float, int]] = []
        pending = sorted((g.ready_s, g.nbytes) for g in prof.grads)
        tick = 0.0
        while pending:
            tick = max(tick, finishes[-1] if finishes else 0.0)
            tick = math.ceil(tick / engine.cycle_s - 1e-9) * engine.cycle_s
            ready_now = [p for p in pending if p[0] <= tick]
            if not ready_now:
                tick = pending[0][0]
                continue
            take, total = [], 0
            for p in ready_now:
                if take and total + p[1] > engine.threshold_bytes:
                    break
                take.append(p)
                total += p[1]
            for p in take:
                pending.remove(p)
            buckets.append((tick, total))
            run(tick + engine.per_bucket_s + total / engine.copy_Bps, total)
    else:
        buckets, delay = _planned_buckets(prof, engine)
        for ready, nbytes in buckets:
            run(ready, nbytes)
    compute_end = prof.compute_end_s + delay
    comm_end = max(finishes, default=0.0)
    end = max(compute_end, comm_end)
    return StepResult(end + prof.tail_s, compute_end, comm_end, max(0.0, comm_end - compute_end),
                      len(buckets), algos, launches, finishes)


def efficiency(profile: Profile, n: int, net: Network, engine: Engine, jitter: Jitter = Jitter()) -> float:
    """Weak-scaling efficiency: 1-rank step time / n-rank step time."""
    one = simulate(profile, 1, net, engine, jitter).step_s
    return one / simulate(profile, n, net, engine, jitter).step_s


THRESHOLDS = (0, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20, 1 << 40)
IN_FLIGHT = (1, 2, 4, INF)


def best_engine(profile: Profile, n: int, net: Network, engine: Engine, jitter: Jitter = Jitter(),
                thresholds: Sequence[int] = THRESHOLDS, in_flight: Sequence[float] = IN_FLIGHT
                ) -> tuple[Engine, StepResult]:
    """The threshold and buckets-in-flight with the shortest predicted step (ties: the
    first in the lists, i.e. the smaller threshold and fewer buckets in flight)."""
    best: tuple[Engine, StepResult] | None = None
    for thr in thresholds:
        for k in in_flight:
            e = replace(engine, threshold_bytes=thr, k=k)
            r = simulate(profile, n, net, e, jitter)
            if best is None or r.step_s < best[1].step_s * (1 - 1e-9):
                best = (e, r)
    assert best is not None
    return best
