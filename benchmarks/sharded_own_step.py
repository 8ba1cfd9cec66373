"""A model's own ``train_step`` at sharding 0, 2 and 3 (docs/sharding.md, "Own train_step"):
per-rank weights stored between steps and measured memory, DATA on 2 ranks.

    python benchmarks/sharded_own_step.py [--steps 3] [--levels 0,2,3]   # one 2-rank launch per level

Level 3 of an own step gathers the whole weights before each step and frees the non-owned
ones after it, so its in-step peak is level 2's and what it saves lies between steps. Each
rank's figures are those of sharded_memory.py (measured peaks, steady-step peak, weight bytes
stored between steps, optimizer bytes, TensorFlow's allocator). The model: sharded_memory's
Dense stack (Psi ~ 8.4 M float32 parameters) with the Keras guide's own step (tape +
``apply_gradients``), Adam.
"""

from __future__ import annotations

import sharded_memory as sm


def worker(level: int, steps: int, out: str) -> None:
    import keras
    import tensorflow as tf

    import tarantella as tnt

    class OwnStep(keras.Sequential):
        """The guide's own train_step: its tape over the trainable variables, apply_gradients."""

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    before = sm.status("VmRSS")
    inner = OwnStep(sm.dense_layers(keras))
    model = tnt.Model(inner, sharding=level)
    model.compile(keras.optimizers.Adam(1e-3))
    figures = sm.measured_fit(model, steps, before)
    sharding = model._tnt_sharding
    held = sm.held_bytes(inner.optimizer, inner.trainable_variables, None if sharding is None else sharding.per_step)
    sm.report(level, {"rank": tnt.get_rank(), **held, **figures}, out)


def line(r: dict) -> str:
    return (f"r{r['rank']} weights stored {r['stored_weight_bytes'] / 1e6:.1f} of {r['weight_bytes'] / 1e6:.1f} MB,"
            f" optimizer {r['optimizer_bytes'] / 1e6:.1f} MB, peak {r['peak_bytes'] / 1e6:.0f} MB"
            f" (steady {r['steady_peak_bytes'] / 1e6:.0f} MB), TF allocator between steps"
            f" {r['tf_between_steps_bytes'] / 1e6:.1f} MB, steady peak {r['tf_steady_peak_bytes'] / 1e6:.1f} MB")


if __name__ == "__main__":
    sm.main(__file__, 2, "0,2,3", worker, line, order=lambda r: (r["rank"],))
