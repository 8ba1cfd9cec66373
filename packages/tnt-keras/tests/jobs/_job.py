"""Shared set-up for job scripts: determinism, threads, the --out argument."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import zipfile
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
    parser.add_argument("--shared", default=None, type=Path,
                        help="a folder common to the session's launches (shared_launch.py, {shared})")
    return parser.parse_args()


def out_path() -> Path:
    return _args().out


def shared_dir() -> Path | None:
    """``--shared``: where a smaller launch's job leaves files for a larger one (launches go in
    ascending rank count), or None."""
    return _args().shared


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


# -- files ---------------------------------------------------------------------------------------
def h5_contents(data: bytes) -> dict:
    """Every group's and dataset's path -> (attributes, value) of an HDF5 file's bytes."""
    import h5py

    out = {}
    with h5py.File(io.BytesIO(data), "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, (
            {k: str(v) for k, v in obj.attrs.items()},
            np.asarray(obj[()]) if isinstance(obj, h5py.Dataset) else None)))
    return out


def config_of(archive: zipfile.ZipFile) -> dict:
    """config.json without Keras' ``shared_object_id`` (an object's address at save time)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "shared_object_id"}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return strip(json.loads(archive.read("config.json")))


def auto_name_counters(restore: dict | None = None) -> dict:
    """Keras' counters of automatic names (an unnamed inner layer's ``dropout_8``): a copy,
    after setting them to ``restore`` when given. A model built from a config after the
    counters were restored gets the inner names an earlier one got, so two files written
    of two builds can be compared attribute by attribute."""
    import collections

    from keras.src.backend.common import global_state

    if restore is not None:
        global_state.set_global_attribute("object_name_uids", collections.defaultdict(int, restore))
    return dict(global_state.get_global_attribute("object_name_uids", default={}) or {})


def same_file_as_keras(path: Path, full, keras_path: Path) -> dict:
    """A tnt-written ``.keras`` file at ``path`` against Keras' own ``full.save`` (at
    ``keras_path``): the same zip members, configuration, HDF5 attributes and bitwise the
    same arrays (``streamed_differing_entries``: the groups/datasets that differ)."""
    full.save(keras_path)
    with zipfile.ZipFile(path) as a, zipfile.ZipFile(keras_path) as b:
        ours, keras_own = h5_contents(a.read("model.weights.h5")), h5_contents(b.read("model.weights.h5"))
        same_config = config_of(a) == config_of(b)
        same_members = a.namelist() == b.namelist()
    differing = sorted(k for k in set(ours) | set(keras_own)
                       if k not in ours or k not in keras_own or ours[k][0] != keras_own[k][0]
                       or (ours[k][1] is not None and not np.array_equal(ours[k][1], keras_own[k][1])))
    return {"streamed_entries": len(ours), "streamed_differing_entries": differing,
            "streamed_same_config": same_config, "streamed_same_members": same_members}
