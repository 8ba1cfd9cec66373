"""Per-rank memory: what a layout's plan says a rank holds while training, and what the
process really used (docs/memory.md).

Every layout describes what it holds with one small hook, ``_tnt_memory_layout()``
(a :class:`Holdings`); from it :func:`estimate` counts the categories a training step keeps
alive at its peak, and :func:`report` puts the measured peak beside them. The same
estimate is what ``memory_budget=`` (``TNT_MEMORY_BUDGET``) is checked against before
training, on every rank, so that a plan that cannot fit fails with the figures and a fix
instead of running into the allocator.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass, field

import numpy as np

#: Resident set size of this process when tarantella was imported (after TensorFlow):
#: what the model, its training and tnt add is measured from here.
_BASELINE_RSS: int | None = None

#: Slot variables per trainable variable of Keras' optimizers (when not built yet).
_SLOTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "Nadam": 2, "Lamb": 2, "Adadelta": 2, "Ftrl": 2,
          "Adagrad": 1, "Lion": 1, "RMSprop": 1, "SGD": 0, "LossScaleOptimizer": 2}

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6, "MIB": 2**20,
          "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12, "TIB": 2**40}

CATEGORIES = ("parameters", "gradients", "optimizer_slots", "gradient_accumulators",
              "activations", "communication_buffers", "receive_buffers", "update_temporaries")

#: Full-size temporaries of one variable's optimizer update (Keras' Adam: ``g - m`` and
#: ``g * g`` beside the variable; measured +128 MiB = 2 x 64 MiB in the update phase of a
#: pipeline stage whose largest kernel is 64 MiB, docs/memory.md).
UPDATE_TEMPORARIES = 2


class MemoryBudgetError(RuntimeError):
    """The plan's per-rank estimate exceeds ``memory_budget`` (raised on every rank)."""


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak so far stands in
        return _max_rss()


def _max_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024  # Linux: KiB


def record_baseline() -> None:
    """Remember the RSS now (tarantella's import, after TensorFlow's): the zero of peaks."""
    global _BASELINE_RSS
    if _BASELINE_RSS is None:
        _BASELINE_RSS = _rss()


def measured_peak_bytes() -> tuple[int, str]:
    """(peak bytes, how measured): on a GPU TensorFlow's peak of device memory; on CPU the
    process' max RSS minus its RSS when tarantella was imported."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        info = tf.config.experimental.get_memory_info(gpus[0].name)
        return int(info["peak"]), f"tf.config.experimental.get_memory_info({gpus[0].name!r})['peak']"
    base = _BASELINE_RSS if _BASELINE_RSS is not None else 0
    return _max_rss() - base, "max RSS - RSS after import tarantella"


def parse_bytes(value) -> int | None:
    """``"6GiB"``, ``"500 MB"``, ``2**30`` -> bytes; None/"" -> None (no budget)."""
    if value is None or value == "":
        return None
    if isinstance(value, int | np.integer) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, float) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value)) if isinstance(value, str) else None
    if m is None or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"memory_budget={value!r} is not a size: use bytes (an int) or a string such as "
                         "'6GiB', '512MiB', '8GB' (units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB).")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def global_batch(x, batch_size) -> int | None:
    """The global batch of fit's ``x`` / ``batch_size`` (None: not told by the dataset)."""
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        import tnt_data

        try:
            return tnt_data.inspect(x).global_batch_size
        except tnt_data.DistributionError:
            return None
    return batch_size or 32  # Keras' default batch size


def budget_from(option) -> int | None:
    """The budget of ``memory_budget=`` or else ``TNT_MEMORY_BUDGET`` (None: no budget)."""
    if option is not None:
        return parse_bytes(option)
    return parse_bytes(os.environ.get("TNT_MEMORY_BUDGET") or None)


@dataclass
class Holdings:
    """What one rank holds, as its layout knows it (the hook ``_tnt_memory_layout``).

    ``model``: the Keras model whose variables live on this rank (the whole model, a stage,
    a model of shards); ``optimizer``: its optimizer (None before compile);
    ``accumulator_sets``: full gradient sets held beside the step's gradients (a pipeline
    sums micro-batches in place, into its gradient set: 0); ``in_flight``: micro-batches in flight at once (their received
    inputs are held); ``activation_sets``: of those, how many keep their activations (None:
    all; 1 under a pipeline's ``remat="stages"``); ``rows``: samples per micro-batch (None: not known before fit);
    ``comm_gradient_sets``: full gradient sets the fused engine stages (its buckets: 1 when
    gradients are reduced over replicas, else 0); ``receive_bytes``: bytes of one
    micro-batch's received boundary tensors (pipelines); ``what``: the layout in words;
    ``counted``: categories the layout counts itself, replacing what the model's variables
    say (sharding level 3 stores only the owned part of most weights).
    """

    model: object
    optimizer: object | None
    what: str
    accumulator_sets: int = 0
    in_flight: int = 1
    activation_sets: int | None = None
    rows: int | None = None
    comm_gradient_sets: int = 0
    receive_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    counted: dict[str, int] = field(default_factory=dict)


def _np_dtype(v) -> np.dtype:
    import tensorflow as tf

    return np.dtype(tf.as_dtype(str(v.dtype)).as_numpy_dtype)


def variable_bytes(variables) -> int:
    """Bytes of Keras variables (shape x dtype size; deferred ones count as if built)."""
    return sum(int(np.prod(v.shape)) * _np_dtype(v).itemsize for v in variables)


def slot_bytes(optimizer, trainable) -> int:
    """Bytes of the optimizer's state: its variables when built, else slots x trainable."""
    if optimizer is None:
        return 0
    if getattr(optimizer, "built", False) and list(optimizer.variables):
        own = {id(v) for v in trainable}
        return variable_bytes(v for v in optimizer.variables if id(v) not in own)
    name = type(getattr(optimizer, "inner_optimizer", optimizer)).__name__
    slots = _SLOTS.get(name, 2)
    if name == "SGD" and getattr(optimizer, "momentum", 0):
        slots = 1
    return slots * variable_bytes(trainable)


def activation_bytes_per_sample(model) -> int | None:
    """Bytes of every layer output of ``model`` per sample (what backprop keeps), from the
    functional graph's symbolic outputs; None when the model has no graph to read."""
    total = 0
    try:
        layers = list(model.layers)
        for layer in layers:
            outs = layer.output if isinstance(layer.output, list | tuple) else [layer.output]
            for o in outs:
                shape = [d for d in tuple(o.shape)[1:]]
                if any(d is None for d in shape):
                    return None
                total += int(np.prod(shape)) * np.dtype(o.dtype).itemsize
    except (AttributeError, ValueError, TypeError):
        return None
    return total


def estimate(h: Holdings) -> dict[str, int]:
    """Bytes per category at the peak of a training step (docs/memory.md has the formulas)."""
    model = h.model
    trainable = list(model.trainable_variables)
    params = variable_bytes(model.variables)
    grads = variable_bytes(trainable)
    per_sample = activation_bytes_per_sample(model)
    sets = h.in_flight if h.activation_sets is None else min(h.activation_sets, h.in_flight)
    acts = (per_sample or 0) * (h.rows or 0) * sets
    return {**{
        "parameters": params,
        "gradients": grads,
        "optimizer_slots": slot_bytes(h.optimizer, trainable),
        "gradient_accumulators": h.accumulator_sets * grads,
        "activations": acts,
        "communication_buffers": h.comm_gradient_sets * grads,
        "receive_buffers": h.receive_bytes * h.in_flight,
        "update_temporaries": update_temporary_bytes(trainable) if h.optimizer is not None else 0,
    }, **h.counted}


def update_temporary_bytes(trainable) -> int:
    """The optimizer update's temporaries at their largest: ``UPDATE_TEMPORARIES`` copies of
    the largest trainable variable (the updates' temporaries are alive one variable at a
    time where the update is chained, and TensorFlow frees each after its last use)."""
    largest = max((variable_bytes([v]) for v in trainable), default=0)
    return UPDATE_TEMPORARIES * largest


def report(model) -> dict:
    """This rank's estimate by category, its total, and the measured peak (see module doc)."""
    from . import runtime as _runtime

    h = model._tnt_memory_layout()
    cats = estimate(h)
    peak, how = measured_peak_bytes()
    return {"rank": _runtime.get_rank(), "layout": h.what, "estimate": cats,
            "total_bytes": sum(cats.values()), "measured_peak_bytes": peak, "measured_as": how,
            "rows_per_micro_batch": h.rows, "micro_batches_in_flight": h.in_flight, "notes": list(h.notes)}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def format_reports(reports: list[dict]) -> str:
    """Every rank's report as one table (MiB)."""
    lines = ["tnt memory report (MiB per rank; docs/memory.md)",
             f"{'':24}" + "".join(f"{'rank ' + str(r['rank']):>12}" for r in reports)]
    for c in CATEGORIES:
        lines.append(f"{c:24}" + "".join(f"{_mib(r['estimate'][c]):>12}" for r in reports))
    lines.append(f"{'estimate, total':24}" + "".join(f"{_mib(r['total_bytes']):>12}" for r in reports))
    lines.append(f"{'measured peak':24}" + "".join(f"{_mib(r['measured_peak_bytes']):>12}" for r in reports))
    lines.append(f"(measured as {reports[0]['measured_as']}; layout: {reports[0]['layout']})")
    return "\n".join(lines)


def all_reports(model) -> list[dict]:
    """Every rank's report, in rank order (a collective)."""
    import tnt_comm

    from . import runtime as _runtime

    mine = report(model)
    return tnt_comm.allgather_object(mine) if _runtime.get_size() > 1 else [mine]


def print_report_if_asked(model) -> None:
    """``TNT_MEMORY_REPORT=1``: every rank's report, printed by the master (a collective)."""
    from . import runtime as _runtime

    if os.environ.get("TNT_MEMORY_REPORT", "0").strip().lower() not in ("1", "true", "yes", "on"):
        return
    reports = all_reports(model)
    if _runtime.is_master_rank():
        print(format_reports(reports), flush=True)


def check_budget(model, budget: int | None) -> None:
    """Raise :class:`MemoryBudgetError` on every rank when some rank's estimate exceeds
    ``budget`` (a collective when a budget is set: every rank decides on all figures)."""
    if budget is None:
        return
    import tnt_comm

    from . import runtime as _runtime

    mine = estimate(model._tnt_memory_layout())
    everyone = tnt_comm.allgather_object(mine) if _runtime.get_size() > 1 else [mine]
    totals = [sum(e.values()) for e in everyone]
    if max(totals) <= budget:
        return
    worst = int(np.argmax(totals))
    big = sorted(everyone[worst].items(), key=lambda kv: -kv[1])[:3]
    raise MemoryBudgetError(
        f"memory_budget={_mib(budget)} MiB per rank is exceeded: the estimate per rank is "
        + ", ".join(f"rank {r}: {_mib(t)} MiB" for r, t in enumerate(totals))
        + f" (rank {worst}: " + ", ".join(f"{k} {_mib(v)} MiB" for k, v in big) + "). "
        "Spread the model over more ranks: more pipeline stages (num_pipeline_stages=), a tensor "
        "group (tensor_parallel_size=, ParallelStrategy.TENSOR or ALL), recomputation of "
        "activations (keras.RematScope), or a smaller micro-batch; or raise memory_budget= / "
        "TNT_MEMORY_BUDGET. model.memory_report() shows every category (docs/memory.md).")


#: glibc's M_MMAP_THRESHOLD (mallopt parameter -3) and tarantella's value for it.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 4 * 2**20


def bound_heap() -> bool:
    """Have glibc serve every allocation of 4 MiB or more (weights, gradients, optimizer
    slots, buckets) with its own mapping, returned to the system when freed.

    By default glibc raises its mmap threshold to the size of each mapped block it frees,
    up to 32 MiB: after the first freed gradient, tensors of up to 32 MiB come from the
    heap, whose freed space is kept and fragments, so the resident set grows beyond what
    is alive (measured on a TENSOR rank: peak 801 -> 726 MiB, 721 -> 591 MiB held after
    fit, docs/memory.md). A fixed threshold turns that adjustment off. Skipped where the
    user set ``MALLOC_MMAP_THRESHOLD_`` or ``TNT_MALLOC_MMAP_THRESHOLD=0``, and off glibc.
    """
    import ctypes
    import ctypes.util

    setting = os.environ.get("TNT_MALLOC_MMAP_THRESHOLD", "").strip()
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or setting == "0" or os.uname().sysname != "Linux":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        value = int(setting) if setting else MMAP_THRESHOLD_BYTES
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(value)))
    except (OSError, AttributeError, ValueError):
        return False


record_baseline()  # imported with tarantella, after TensorFlow
bound_heap()


__all__ = ["CATEGORIES", "Holdings", "MemoryBudgetError", "all_reports", "budget_from", "check_budget",
           "estimate", "format_reports", "measured_peak_bytes", "parse_bytes", "print_report_if_asked",
           "record_baseline", "report"]
