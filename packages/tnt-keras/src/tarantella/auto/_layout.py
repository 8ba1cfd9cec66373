"""A layout the planner considers: d data replicas x p pipeline stages x t-rank tensor
groups, with DATA's sharding level and the pipeline's micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

from .._core.strategy import ParallelStrategy


@dataclass(frozen=True)
class Layout:
    """``replicas * stages * tensor == num_ranks``; ``sharding`` only with replicas (DATA's,
    or ALL's replicas of stages or of tensor groups); ``micro_batches`` only with
    ``stages > 1``."""

    replicas: int
    stages: int = 1
    tensor: int = 1
    sharding: int = 0
    micro_batches: int = 1
    remat: bool = False  # the pipeline's stages recompute their activations (remat="stages")
    split_after: tuple[str, ...] | None = None  # the pipeline's cut points (None: automatic)
    partition: str = ""  # how the stages were balanced: "bytes" (the pipeline's plan) or "time"

    @property
    def num_ranks(self) -> int:
        """Ranks the layout takes: d x p x t."""
        return self.replicas * self.stages * self.tensor

    @property
    def strategy(self) -> ParallelStrategy:
        """The strategy that builds it (two or more of d, p, t above 1: ALL)."""
        if self.stages == 1 and self.tensor == 1:
            return ParallelStrategy.DATA
        if self.tensor == 1 and self.replicas == 1:
            return ParallelStrategy.PIPELINING
        if self.stages == 1 and self.replicas == 1:
            return ParallelStrategy.TENSOR
        return ParallelStrategy.ALL

    def describe(self) -> str:
        """``DATA(d=2, sharding=1)``, ``PIPELINING(d=1, p=2 m=4)``, ...: the summary's name."""
        parts = [f"d={self.replicas}"]
        if self.stages > 1:
            by = f" {self.partition}" if self.partition else ""
            parts.append(f"p={self.stages} m={self.micro_batches}{by}" + (" remat" if self.remat else ""))
        if self.tensor > 1:
            parts.append(f"t={self.tensor}")
        if self.sharding:
            parts.append(f"sharding={self.sharding}")
        return f"{self.strategy.name}({', '.join(parts)})"

    def model_options(self) -> tuple[ParallelStrategy, dict]:
        """The ``tnt.Model`` strategy and options that build this layout."""
        member = self.strategy
        if member is ParallelStrategy.DATA:
            return member, {"sharding": self.sharding}
        options: dict = {}
        if self.stages > 1:
            options["num_pipeline_stages"] = self.stages
            options["num_micro_batches"] = self.micro_batches
            if self.remat:
                options["remat"] = "stages"
        if self.tensor > 1:
            options["tensor_parallel_size"] = self.tensor
        if self.sharding:  # ALL's replica axis (PIPELINING and TENSOR have none)
            options["sharding"] = self.sharding
        return member, options
