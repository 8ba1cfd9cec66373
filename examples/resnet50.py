"""ResNet-50 on synthetic ImageNet-shaped data, data-parallel with Tarantella.

    tarantella -n 4 -- examples/resnet50.py          # 224x224 images, 1000 classes
    python examples/resnet50.py                      # the same on 1 rank

The test runs it in about a minute, with 32x32 images of 4 classes:

    tarantella -n 2 -- examples/resnet50.py --steps 6 --epochs 3 --image-size 32
        --classes 4 --micro-batch-size 8 --learning-rate 0.0005 --warmup-steps 2

The original Tarantella ResNet-50 recipe, in Keras 3:

- the global batch is the micro-batch per rank times the number of ranks, so each rank
  keeps the work (and memory) per step of a single-device run;
- the learning rate grows with the number of ranks (linear scaling), reached by a linear
  warm-up, then decays: one `keras.optimizers.schedules.LearningRateSchedule`;
- `ModelCheckpoint` (written by the master rank) and `BackupAndRestore` (start the same
  command again after a crash and training resumes after the last completed epoch).

The data are generated, not downloaded: each class is an image whose mean colour is a
fixed function of the class, plus noise.

What the test's tiny run (18 steps of a ResNet-50 from scratch, global batch 16)
demonstrates is the recipe: the scaled learning rate and its schedule, checkpoints, a
backup removed once training completes. It is too short to learn reliably: the last
epoch's training accuracy lands anywhere from 0.45 to 0.52 (chance: 0.25) with the CPU's
kernels (oneDNN on or off, the instruction set) and the seed, and `evaluate` is no better
than chance because BatchNormalization's moving statistics (momentum 0.99) still hold
mostly their initial values after 18 steps. Train for the default 100 steps or more to
see the classes learnt.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt


class WarmupThenDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from ``peak / warmup_steps`` to ``peak``, then cosine decay to 0.

    With N ranks the global batch is N times larger, so ``peak`` is the single-device
    learning rate times N (the linear scaling rule); the warm-up keeps the first steps of
    a large global batch stable.
    """

    def __init__(self, peak: float, warmup_steps: int, total_steps: int) -> None:
        self.peak = peak
        self.warmup_steps = max(1, warmup_steps)
        self.total_steps = max(total_steps, self.warmup_steps + 1)

    def __call__(self, step):
        step = keras.ops.cast(step, "float32") + 1.0
        warmup = self.peak * step / self.warmup_steps
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        decay = 0.5 * self.peak * (1.0 + keras.ops.cos(math.pi * keras.ops.clip(progress, 0.0, 1.0)))
        return keras.ops.where(step <= self.warmup_steps, warmup, decay)

    def get_config(self) -> dict:
        return {"peak": self.peak, "warmup_steps": self.warmup_steps, "total_steps": self.total_steps}


def synthetic_images(samples: int, image_size: int, classes: int, seed: int) -> tf.data.Dataset:
    """ImageNet-shaped samples (HxWx3 floats, integer labels) made on the fly, same on every rank.

    Class c is a plain image of a colour fixed by c, plus Gaussian noise: learnable in a few
    steps, so the printed accuracy says whether training works.
    """
    colours = np.random.default_rng(0).uniform(-1.0, 1.0, size=(classes, 3)).astype("float32")
    labels = np.random.default_rng(seed).integers(0, classes, size=samples).astype("int32")

    def make(index, label):
        noise = tf.random.stateless_normal((image_size, image_size, 3), seed=[seed, index], stddev=0.3)
        return tf.gather(colours, label)[None, None, :] + noise, label

    indices = tf.data.Dataset.range(samples)
    return tf.data.Dataset.zip(indices, tf.data.Dataset.from_tensor_slices(labels)).map(make)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch-size", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=100, help="training steps per epoch")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--learning-rate", type=float, default=0.0125,
        help="peak rate of one device with --micro-batch-size samples (0.1 per 256, Goyal et al.)",
    )
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: half of an epoch")
    parser.add_argument("--seed", type=int, default=42, help="weights, data and shuffling")
    parser.add_argument("--workdir", type=Path, default=None, help="checkpoints and backups")
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)
    ranks = tnt.get_size()
    global_batch = args.micro_batch_size * ranks
    peak = args.learning_rate * ranks
    total_steps = args.steps * args.epochs
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 2)

    train = synthetic_images(args.steps * global_batch, args.image_size, args.classes, seed=args.seed + 1)
    train = train.shuffle(1024, seed=args.seed + 7).batch(global_batch).prefetch(tf.data.AUTOTUNE)
    test = synthetic_images(4 * global_batch, args.image_size, args.classes, seed=args.seed + 2)
    test = test.batch(global_batch)

    model = tnt.Model(
        keras.applications.ResNet50(
            weights=None, input_shape=(args.image_size, args.image_size, 3), classes=args.classes
        )
    )
    model.compile(
        optimizer=keras.optimizers.SGD(WarmupThenDecay(peak, warmup, total_steps), momentum=0.9),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )

    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        callbacks = [
            keras.callbacks.ModelCheckpoint(str(workdir / "resnet50.keras")),
            keras.callbacks.BackupAndRestore(str(workdir / "backup")),
        ]
        history = model.fit(train, epochs=args.epochs, callbacks=callbacks, verbose=2)
        saved = (workdir / "resnet50.keras").exists()
    loss, accuracy = model.evaluate(test, verbose=0)
    if tnt.is_master_rank():
        # After a few steps (the test's tiny run) BatchNormalization's moving averages have
        # not settled yet, so evaluate lags behind training.
        print(
            f"ranks: {ranks}  global batch: {global_batch}  peak lr: {peak:g}  "
            f"iterations: {int(model.optimizer.iterations.numpy())}  "
            f"train loss: {history.history['loss'][-1]:.4g}  "
            f"train accuracy: {history.history['accuracy'][-1]:.4f}  "
            f"test accuracy: {accuracy:.4f}  test loss: {loss:.4g}  "
            f"checkpoint: {'yes' if saved else 'no'}"
        )


if __name__ == "__main__":
    main()
