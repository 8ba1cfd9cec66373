"""A GAN with its own train_step and two optimizers, data-parallel with Tarantella.

    tarantella -n 2 -- examples/custom_train_step_gan.py
    python examples/custom_train_step_gan.py              # the same script on 1 rank

The pattern of the Keras guide "Customizing what happens in fit()": a `keras.Model`
subclass whose `train_step` updates a discriminator and a generator with their own
optimizers and reports two loss trackers. `tnt.Model` runs that step on each rank's share
of every global batch; both optimizers apply the gradient of the global batch, and the
trackers report global values (docs/keras.md, "Custom train_step"). The latent noise comes
with the data, so a run on N ranks reproduces the serial one.

The generator learns to produce 2-D points from a Gaussian centred at (2, -1); the script
prints how far the mean of its samples is from that centre at the end and at its closest
approach. A GAN trained with Adam does not settle: after the generator's mean first reaches
the centre (from 2.2 away, within 6-9 epochs here), it orbits it at 0.2-1.5 while the
discriminator chases it, so the error at the last epoch depends on where in its orbit
training stops; the closest approach shows that the generator learnt where the data are.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt

LATENT = 4
CENTRE = np.array([2.0, -1.0], dtype="float32")


class GAN(keras.Model):
    def __init__(self, latent: int = LATENT):
        super().__init__()
        self.discriminator = keras.Sequential([
            keras.Input((2,)), keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid")])
        self.generator = keras.Sequential([
            keras.Input((latent,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)])
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, data):
        real, noise = data
        fake = self.generator(noise)
        points = tf.concat([fake, real], axis=0)
        labels = tf.concat([tf.ones_like(fake[:, :1]), tf.zeros_like(real[:, :1])], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(points))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:  # the generator wants "real" (0) answers
            g_loss = self.loss_fn(tf.zeros_like(fake[:, :1]), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


class MeanError(keras.callbacks.Callback):
    """After every epoch: how far the mean of the generator's samples is from CENTRE."""

    def __init__(self, noise: np.ndarray) -> None:
        super().__init__()
        self.noise = noise
        self.errors: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        samples = self.model.generator.predict(self.noise, verbose=0)
        self.errors.append(float(np.linalg.norm(samples.mean(axis=0) - CENTRE)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=1, help="initial weights and Keras' other random draws")
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(0)
    real = (CENTRE + 0.5 * rng.normal(size=(args.samples, 2))).astype("float32")
    noise = rng.normal(size=(args.samples, LATENT)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((real, noise)).shuffle(args.samples, seed=2).batch(args.batch_size)

    gan = tnt.Model(GAN())                      # the one changed line (with the import)
    gan.compile(d_optimizer=keras.optimizers.Adam(1e-3), g_optimizer=keras.optimizers.Adam(1e-3),
                loss_fn=keras.losses.BinaryCrossentropy())
    error = MeanError(rng.normal(size=(1000, LATENT)).astype("float32"))
    history = gan.fit(dataset, epochs=args.epochs, callbacks=[error], verbose=2 if tnt.is_master_rank() else 0)

    if tnt.is_master_rank():
        closest = int(np.argmin(error.errors))
        print(f"ranks: {tnt.get_size()}  d_loss: {history.history['d_loss'][-1]:.4f}  "
              f"g_loss: {history.history['g_loss'][-1]:.4f}  generated mean error: {error.errors[-1]:.4f}  "
              f"closest: {error.errors[closest]:.4f} (epoch {closest + 1})")


if __name__ == "__main__":
    main()
