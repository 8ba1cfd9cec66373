"""The fused allreduce engine: buckets of tensors reduced while the caller still submits."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from . import _runtime
from ._comm import Communicator, Op
from ._dtypes import as_dtype, check_reducible

_core = _runtime._core


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of the fused engine: a name (for messages), element count and dtype."""

    name: str
    count: int
    dtype: Any  # anything np.dtype() accepts; stored as np.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        check_reducible(self.dtype, f"TensorSpec {self.name!r}")
        if isinstance(self.count, bool) or int(self.count) != self.count or self.count < 0:
            raise ValueError(f"TensorSpec {self.name!r}: count must be an int >= 0, got {self.count!r}")
        object.__setattr__(self, "count", int(self.count))

    @property
    def nbytes(self) -> int:
        """Size of the tensor in bytes (count x itemsize)."""
        return self.count * self.dtype.itemsize


def _raw(specs: Sequence[TensorSpec]) -> list[tuple[str, int, str]]:
    out = []
    for i, s in enumerate(specs):
        if not isinstance(s, TensorSpec):
            raise TypeError(f"specs[{i}] is a {type(s).__name__}, expected tnt_comm.TensorSpec")
        out.append((s.name, s.count, s.dtype.name))
    return out


def plan_buckets(specs: Sequence[TensorSpec], threshold_bytes: int) -> list[list[int]]:
    """Which tensors share a bucket: lists of spec indices, in launch order.

    Rule: walk the specs in order keeping one open bucket per dtype; a tensor joins the
    open bucket of its dtype unless the bucket would then exceed ``threshold_bytes``, in
    which case that bucket closes and the tensor starts a new one. So a tensor larger
    than the threshold gets its own bucket, dtypes never mix, and ``threshold_bytes=0``
    means one tensor per bucket. Buckets are ordered by their first tensor index. A pure
    function: every rank computes the same plan without communicating.
    """
    return [list(b) for b in _core.plan_buckets(_raw(specs), int(threshold_bytes))]


class FusedAllreduce:
    """Allreduce of a fixed, ordered list of tensors, fused into buckets.

    Construction is collective over ``comm`` (every member passes the same specs,
    threshold and op; checked). Each round: ``submit`` every tensor once (any thread,
    any order; returns at once), then ``wait`` returns all reduced tensors. Buckets are
    reduced in plan order as soon as they are complete, overlapping the remaining
    submissions, several in flight at once.

    ``comm``: the ranks to reduce over (e.g. a replica group from ``world().split``);
    default: the world. Either way the engine works on its own duplicate of it, so two
    engines used at the same time can never mix up their buckets.

    ``slot_alignment``: each tensor starts at a multiple of this many bytes inside its
    bucket (a power of two; 1 packs them back to back). With 64, a framework can take
    each tensor out of a ``wait_buckets`` result without a copy (TensorFlow shares a
    slice's memory only when it starts 64-byte aligned); ``slot_offsets`` says where
    each tensor starts. The padding is zeros.
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        threshold_bytes: int,
        op: Op = Op.SUM,
        comm: Communicator | None = None,
        slot_alignment: int = 1,
    ) -> None:
        self._specs = tuple(specs)
        raw = _raw(self._specs)
        op = Op(op)  # AVG of integer tensors: refused by the core, naming the tensor
        if comm is not None and not isinstance(comm, Communicator):
            raise TypeError(f"FusedAllreduce: comm must be a tnt_comm.Communicator, got {type(comm).__name__}")
        _runtime.ensure()
        self._core = _core.FusedAllreduce(
            raw,
            int(threshold_bytes),
            int(op),
            [s.dtype for s in self._specs],
            None if comm is None else comm._core,
            int(slot_alignment),
        )
        self._plan = [list(b) for b in self._core.plan]
        self._offsets = list(self._core.slot_offsets)
        self._op = op
        # The calls of every round go straight to the core: a Python frame per call was
        # ~0.1 us of a ~10 us small round (the methods below keep the documentation; the
        # core checks every argument and raises the same errors).
        # A subclass that overrides one of them (to time it, say) keeps its override.
        for name in ("submit", "wait", "wait_buckets"):
            if getattr(type(self), name) is getattr(FusedAllreduce, name):
                setattr(self, name, getattr(self._core, name))

    @property
    def plan(self) -> list[list[int]]:
        """The buckets, as lists of spec indices, ordered by first index (see plan_buckets)."""
        return [list(b) for b in self._plan]

    @property
    def launch_order(self) -> list[int]:
        """Bucket indices (into ``plan``) in the order every rank launches them: buckets
        over the threshold first, then the others, each in plan order (Note [Large buckets
        first] in fused.cc: a small gradient computed late does not hold back the large ones)."""
        return list(self._core.launch_order)

    @property
    def slot_offsets(self) -> list[int]:
        """Where each tensor (spec order) starts inside its bucket, in elements."""
        return list(self._offsets)

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        """The tensors this engine reduces, in the order it was given them."""
        return self._specs

    def submit(self, index: int, array: np.ndarray) -> None:
        """Copy ``array`` into its bucket; launches the buckets that became complete.

        Errors name the tensor: an index out of range (IndexError), a dtype other than
        its spec's (TypeError), another element count or a non-contiguous array
        (ValueError); checked once, in the core.
        """
        self._core.submit(index, array)

    def submit_many(self, indices: Sequence[int], arrays: Sequence[np.ndarray]) -> None:
        """``submit`` for several tensors in one call: one lock, no per-tensor Python cost.

        The form for many small tensors (and for a caller that has a whole bucket's
        tensors at once). All-or-nothing: if any array does not match its spec, or an
        index repeats or was submitted already, nothing is taken and the error names it.
        """
        # Checked in C++ (one pass, messages name the tensor): a Python loop here would
        # cost as much as the copies themselves.
        self._core.submit_many(
            indices if isinstance(indices, (list, tuple, range)) else list(indices),
            arrays if isinstance(arrays, (list, tuple)) else list(arrays),
        )

    def wait(self) -> list[np.ndarray]:
        """All reduced tensors in spec order (1-D, ``count`` elements each); re-arms."""
        return self._core.wait()

    def wait_buckets(self) -> list[np.ndarray]:
        """As ``wait``, but one 1-D array per bucket, in plan order; re-arms.

        Bucket ``b`` holds the tensors ``plan[b]`` in that order, back to back (so
        ``np.split(result[b], np.cumsum(counts)[:-1])`` gives them) unless
        ``slot_alignment`` > 1: tensor ``i`` then starts at ``slot_offsets[i]``. With many
        small tensors this skips creating one array object per tensor.
        """
        return self._core.wait_buckets()

    def native_handle(self) -> int:
        """This engine's id for native code (``tnt_comm_c_api.h``: ``fused_submit``,
        ``fused_wait_buckets``). Valid while this engine lives."""
        return int(self._core.native_handle())

    def close(self) -> None:
        """Refuse further use; a pending wait() fails. In-flight buckets still finish."""
        self._core.close()

    def __enter__(self) -> FusedAllreduce:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
