"""The planner's answer: the chosen layout, the feasible alternatives and the rejected
layouts with their reasons, and ``summary()`` to print them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .._core.memory import CATEGORIES
from ._comm import Network
from ._cost import Estimate
from ._layout import Layout


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


@dataclass
class Candidate:
    """A layout with its prediction; ``rejected``: why it was not taken (None: feasible)."""

    layout: Layout
    estimate: Estimate | None
    rejected: str | None = None


@dataclass
class Plan:
    """What ``tnt.plan_parallel`` chose for ``num_ranks`` ranks, and why.

    Edit it with :meth:`with_layout` (for example another sharding level, more
    micro-batches) and pass it back: ``tnt.Model(model, plan=plan)``.
    """

    num_ranks: int
    global_batch_size: int
    memory_budget: int | None
    budget_source: str
    choice: Candidate
    feasible: list[Candidate]  # fastest first; the choice is the first
    rejected: list[Candidate]
    notes: list[str] = field(default_factory=list)
    network: Network = field(default_factory=Network)  # the alpha and beta its times were priced with

    @property
    def layout(self) -> Layout:
        """The chosen layout."""
        return self.choice.layout

    @property
    def step_time_s(self) -> float:
        """Predicted seconds per training step of the chosen layout."""
        return self.choice.estimate.step_s

    @property
    def samples_per_s(self) -> float:
        """Predicted training throughput of the chosen layout."""
        return self.global_batch_size / self.step_time_s

    @property
    def memory_per_rank(self) -> dict[str, int]:
        """Predicted bytes by category on the fullest rank of the chosen layout."""
        return dict(self.choice.estimate.memory)

    def model_options(self):
        """(``ParallelStrategy``, options) that build the chosen layout with ``tnt.Model``."""
        return self.layout.model_options()

    def with_layout(self, layout: Layout) -> Plan:
        """This plan with ``layout`` chosen instead (it must be one the planner predicted)."""
        for c in (*self.feasible, *self.rejected):
            if c.layout == layout and c.estimate is not None:
                return replace(self, choice=c)
        raise ValueError(f"{layout.describe()} is not a layout this plan predicted; choose one of "
                         + ", ".join(c.layout.describe() for c in self.feasible) + ".")

    def summary(self, print_fn=print) -> str:
        """The chosen plan, the next best ones and the rejections, as text (also printed)."""
        budget = _mib(self.memory_budget) if self.memory_budget else "none"
        lines = [f"tnt.plan_parallel: {self.num_ranks} rank(s), global batch {self.global_batch_size}, "
                 f"memory budget {budget} per rank ({self.budget_source})",
                 f"chosen: {self.layout.describe()}: predicted step {self.step_time_s * 1e3:,.1f} ms, "
                 f"{self.samples_per_s:,.1f} samples/s, {_mib(self.choice.estimate.total_bytes)} per rank"]
        mem = self.choice.estimate.memory
        lines.append("  per rank: " + ", ".join(f"{c} {_mib(mem[c])}" for c in CATEGORIES if mem.get(c)))
        best = self.step_time_s
        width = max([34, *(len(c.layout.describe()) + 1 for c in [*self.feasible, *self.rejected])])
        lines.append(f"{'layout':{width}}{'step ms':>10}{'MiB/rank':>11}  verdict")
        for c in self.feasible:
            verdict = "chosen" if c is self.choice else f"slower by {100 * (c.estimate.step_s / best - 1):.0f} %"
            lines.append(f"{c.layout.describe():{width}}{c.estimate.step_s * 1e3:>10,.1f}"
                         f"{c.estimate.total_bytes / 2**20:>11,.1f}  {verdict}")
        for c in self.rejected:
            step = f"{c.estimate.step_s * 1e3:>10,.1f}" if c.estimate else f"{'-':>10}"
            mib = f"{c.estimate.total_bytes / 2**20:>11,.1f}" if c.estimate else f"{'-':>11}"
            lines.append(f"{c.layout.describe():{width}}{step}{mib}  rejected: {c.rejected}")
        lines.extend(f"note: {n}" for n in self.notes)
        text = "\n".join(lines)
        if print_fn is not None:
            print_fn(text)
        return text
