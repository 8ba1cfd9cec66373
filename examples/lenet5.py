"""LeNet-5 on handwritten digits, data-parallel with Tarantella.

    tarantella -n 2 -- examples/lenet5.py                 # scikit-learn's bundled digits (offline)
    tarantella -n 2 -- examples/lenet5.py --dataset mnist # keras.datasets.mnist (downloads once)
    python examples/lenet5.py                             # the same script on 1 rank

Compared with a serial Keras script, two lines change: `import tarantella as tnt` and
`model = tnt.Model(model)`. The dataset is batched with the GLOBAL batch size; each rank
trains on its share of every batch.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt


def load_digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """scikit-learn's 1797 8x8 digits, scaled to [0, 1]; the last 20% are the test set."""
    from sklearn.datasets import load_digits as sk_digits

    digits = sk_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def load_mnist():
    (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
    prep = lambda a: (a / 255.0).astype("float32")[..., None]  # noqa: E731
    return (prep(x_train), y_train.astype("int32")), (prep(x_test), y_test.astype("int32"))


def lenet5() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(6, 5, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(16, 5, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(120, activation="relu"),
            keras.layers.Dense(84, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="lenet5",
    )


def pipeline(x, y, batch_size: int, shuffle: bool) -> tf.data.Dataset:
    """Batched with the global batch size; 8x8 digits are resized to LeNet's 28x28."""
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        ds = ds.shuffle(len(x), seed=42)
    if x.shape[1] != 28:
        ds = ds.map(lambda img, label: (tf.image.resize(img, (28, 28)), label))
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=1234, help="initial weights and Keras' other random draws")
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_digits() if args.dataset == "digits" else load_mnist()

    model = tnt.Model(lenet5())
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(pipeline(x_train, y_train, args.batch_size, shuffle=True), epochs=args.epochs, verbose=2)
    loss, accuracy = model.evaluate(pipeline(x_test, y_test, args.batch_size, shuffle=False), verbose=0)
    if tnt.is_master_rank():
        print(f"ranks: {tnt.get_size()}  test loss: {loss:.4f}  test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
