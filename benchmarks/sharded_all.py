"""Sharding on ALL's replica axis (docs/sharding.md, "ALL"): per-rank optimizer state and
measured peak of 2 pipeline stages x 2 replicas at sharding 0, 1, 2 and 3.

    python benchmarks/sharded_all.py [--steps 3] [--levels 0,1,2,3]   # one 4-rank launch per level

Each rank's figures are those of sharded_memory.py (measured peaks, steady-step peak, weight
bytes stored between steps, optimizer bytes, TensorFlow's allocator), for its stage. The
model: sharded_memory's Dense stack (Psi ~ 8.4 M float32 parameters), Adam, cut into 2 stages.
"""

from __future__ import annotations

import sharded_memory as sm


def worker(level: int, steps: int, out: str) -> None:
    import keras

    import tarantella as tnt

    before = sm.status("VmRSS")
    model = tnt.Model(keras.Sequential(sm.dense_layers(keras)), parallel_strategy=tnt.ParallelStrategy.ALL,
                      num_pipeline_stages=2, num_micro_batches=2, sharding=level)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    figures = sm.measured_fit(model, steps, before)
    held = sm.held_bytes(model._tnt_stage.optimizer, model.stage_model.trainable_variables, model._tnt_stage.shards)
    sm.report(level, {"stage": model.stage, "replica": model.replica, **held, **figures}, out)


def line(r: dict) -> str:
    return (f"s{r['stage']}r{r['replica']} optimizer {r['optimizer_bytes'] / 1e6:.1f} MB peak {r['peak_bytes'] / 1e6:.0f} MB"
            f" (steady {r['steady_peak_bytes'] / 1e6:.0f} MB) weights stored {r['stored_weight_bytes'] / 1e6:.1f} MB"
            f" TF allocator between steps {r['tf_between_steps_bytes'] / 1e6:.1f} MB,"
            f" steady peak {r['tf_steady_peak_bytes'] / 1e6:.1f} MB")


if __name__ == "__main__":
    sm.main(__file__, 4, "0,1,2,3", worker, line, order=lambda r: (r["stage"], r["replica"]))
