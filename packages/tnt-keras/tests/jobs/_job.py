"""Shared set-up for job scripts: determinism, threads, the --out argument."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

tf.config.experimental.enable_op_determinism()
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

import tarantella as tnt  # noqa: E402


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    return parser.parse_args()


def out_path() -> Path:
    return _args().out


def only(names) -> list[str]:
    """The cases this launch runs: those named by ``--only``, else all of ``names``."""
    wanted = [n for n in _args().only.split(",") if n]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise SystemExit(f"--only names unknown cases {unknown}; known: {sorted(names)}")
    return wanted or list(names)


def timed(name: str, run):
    """``run()``, with its duration printed by the master on stderr (progress in test logs)."""
    t0 = time.perf_counter()
    result = run()
    if tnt.is_master_rank():
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return result


def write(out: Path, results: dict) -> None:
    """Rank 0 writes the results (after every rank got here)."""
    if tnt.is_master_rank():
        out.write_text(json.dumps(results, indent=1, default=float))


def max_abs_diff(a, b) -> float:
    a_leaves, b_leaves = tf.nest.flatten(a), tf.nest.flatten(b)
    assert len(a_leaves) == len(b_leaves), (len(a_leaves), len(b_leaves))
    worst = 0.0
    for x, y in zip(a_leaves, b_leaves):
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        assert x.shape == y.shape, (x.shape, y.shape)
        if x.size:  # NaN against a number is an infinite difference (NaN against NaN none)
            diff = np.where(np.isnan(x) & np.isnan(y), 0.0, np.abs(x - y))
            worst = max(worst, float("inf") if np.isnan(diff).any() else float(np.max(diff)))
    return worst


def history_diff(h1: dict, h2: dict) -> float:
    assert sorted(h1) == sorted(h2), (sorted(h1), sorted(h2))
    for key in h1:
        assert len(h1[key]) == len(h2[key]), (key, len(h1[key]), len(h2[key]))
    return max_abs_diff([h1[k] for k in sorted(h1)], [h2[k] for k in sorted(h2)])


def max_rel_diff(a, b) -> float:
    """Largest difference per array relative to the array's largest magnitude when that is
    above 1 (batch normalisation's moving variances grow large; docs/models.md's rule)."""
    worst = 0.0
    for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b), strict=True):
        x = np.asarray(x, dtype=np.float64)
        scale = max(1.0, float(np.max(np.abs(x)))) if x.size else 1.0
        worst = max(worst, max_abs_diff(x, y) / scale)
    return worst
