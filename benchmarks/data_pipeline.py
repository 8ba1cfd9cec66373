"""Input-pipeline benchmark: early split vs split after the batch (tnt_data.distribute).

    python benchmarks/data_pipeline.py [--quick]

A map-heavy pipeline as in image training: JPEG-encoded 256x256 images are decoded,
randomly flipped, colour-jittered, resized to 224x224 and normalised in a parallel tf.data map, then
batched with the global batch. For N = 1, 2, 4 ranks, simulated one after the other in
this process (each rank's pipeline may use all cores, as a rank with its own cores would),
every rank's dataset from tnt_data.distribute is iterated for one epoch with
split="auto" (early: each rank decodes its own samples only) and split="after_batch"
(each rank decodes every sample and keeps its slice). Reported per rank: samples it
receives, map calls it makes (counted in the map during the warm-up epoch), epoch
seconds and elements/s; times are the median of several epochs after the warm-up, timed round-robin. Prints a table and writes
benchmarks/results/data_pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import tnt_data

HERE = Path(__file__).parent


def encoded_images(count: int, side: int = 256) -> tf.Tensor:
    """JPEG bytes of ``count`` random images: decoding them is the expensive part."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(count, side, side, 3), dtype=np.uint8)
    return tf.stack([tf.io.encode_jpeg(p, quality=90) for p in pixels])


def pipeline(data: tf.Tensor, labels: np.ndarray, gbs: int, calls: tf.Variable) -> tf.data.Dataset:
    def decode(jpeg: tf.Tensor, label: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        calls.assign_add(1)
        img = tf.io.decode_jpeg(jpeg, channels=3)
        img = tf.image.random_flip_left_right(img)
        img = tf.image.resize(img, [224, 224])
        img = tf.image.random_brightness(img, 0.2)
        img = tf.image.random_contrast(img, 0.8, 1.2)
        img = tf.image.per_image_standardization(img)
        return img, label

    ds = tf.data.Dataset.from_tensor_slices((data, labels)).shuffle(len(labels), seed=1)
    ds = ds.map(decode, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(gbs).prefetch(tf.data.AUTOTUNE)


def epoch(ds: tf.data.Dataset) -> tuple[int, float]:
    start = time.perf_counter()
    samples = sum(int(x.shape[0]) for x, _ in ds)
    return samples, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer images and repetitions")
    args = parser.parse_args()
    count, reps = (128, 2) if args.quick else (768, 5)
    gbs = 64
    data = encoded_images(count)
    labels = np.arange(count, dtype=np.int64)
    calls = tf.Variable(0, dtype=tf.int64)

    # Build every rank's dataset first, then time the epochs round-robin, so machine noise
    # (other processes on these shared cores) hits every configuration alike.
    configs = []
    for size in (1, 2, 4):
        for split in ("auto", "after_batch") if size > 1 else ("auto",):
            mode = tnt_data.split_strategy(pipeline(data, labels, gbs, calls), size=size,
                                           split=split).mode
            for rank in range(size):
                ds = tnt_data.distribute(pipeline(data, labels, gbs, calls), rank=rank, size=size,
                                         split=split)
                calls.assign(0)
                samples, _ = epoch(ds)  # warm-up, counting map calls
                configs.append({
                    "ranks": size, "split": mode if size > 1 else "serial", "rank": rank,
                    "samples": samples, "map_calls": int(calls.numpy()), "dataset": ds,
                    "times": [],
                })
    for _ in range(reps):
        for c in configs:
            c["times"].append(epoch(c["dataset"])[1])
    rows = []
    for c in configs:
        sec = statistics.median(c["times"])
        rows.append({k: v for k, v in c.items() if k not in ("dataset", "times")}
                    | {"seconds": sec, "elements_per_s": c["samples"] / sec})

    serial = next(r for r in rows if r["ranks"] == 1)
    print(f"tnt_data.distribute, {count} JPEG images 256x256 -> 224x224, global batch {gbs}, "
          f"{os.cpu_count()} cores; median of {reps} epochs")
    print(f"{'N':>2} {'split':>11} {'rank':>4} {'samples':>7} {'map calls':>9} "
          f"{'epoch s':>8} {'elem/s':>8} {'epoch vs serial':>15}")
    for r in rows:
        print(f"{r['ranks']:>2} {r['split']:>11} {r['rank']:>4} {r['samples']:>7} "
              f"{r['map_calls']:>9} {r['seconds']:>8.3f} {r['elements_per_s']:>8.0f} "
              f"{r['seconds'] / serial['seconds']:>14.2f}x")
    summary = []
    for size in (2, 4):
        for split in ("early", "after_batch"):
            mine = [r for r in rows if r["ranks"] == size and r["split"] == split]
            if mine:
                summary.append({
                    "ranks": size, "split": split,
                    "max_map_calls_per_rank": max(r["map_calls"] for r in mine),
                    "map_calls_fraction": max(r["map_calls"] for r in mine) / count,
                    "slowest_rank_epoch_vs_serial": max(r["seconds"] for r in mine) / serial["seconds"],
                })
    print("\nsummary (slowest rank): map calls / dataset size, epoch time / serial epoch time")
    for s in summary:
        print(f"  N={s['ranks']} {s['split']:>11}: map calls {s['map_calls_fraction']:.2f}, "
              f"epoch {s['slowest_rank_epoch_vs_serial']:.2f}x")

    out = HERE / "results" / "data_pipeline.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "data_pipeline",
        "images": count, "global_batch": gbs, "repetitions": reps,
        "tensorflow": tf.__version__, "python": platform.python_version(),
        "cpus": os.cpu_count(), "rows": rows, "summary": summary,
    }, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
