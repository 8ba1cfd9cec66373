"""An MLP on handwritten digits, cut into pipeline stages on different ranks.

    tarantella -n 2 -- examples/pipeline_mlp.py           # 2 stages, one per rank
    tarantella -n 4 -- examples/pipeline_mlp.py --all     # 2 stages x 2 data-parallel replicas
    python examples/pipeline_mlp.py                       # 1 rank: plain data-parallel path

A SplitLayer marks where stage 0 ends; each rank builds and trains only its own stage.
The model is built under `tnt.pipelining.deferred_variables()`, so no rank ever holds
all of its weights (the layers know their shapes; each rank gives values to its stage's).
Compared with a serial Keras script: `import tarantella as tnt`, the marker, and
`tnt.Model(model, parallel_strategy=..., num_micro_batches=...)`. The dataset is batched
with the GLOBAL batch size; it is cut into micro-batches that flow through the stages.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt


def load_digits():
    """scikit-learn's 1797 8x8 digits as 64 features in [0, 1]; the last 20% test."""
    from sklearn.datasets import load_digits as sk_digits

    digits = sk_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def mlp() -> keras.Model:
    x = inputs = keras.Input((64,), name="pixels")
    x = keras.layers.Dense(256, activation="relu", name="hidden0")(x)
    x = keras.layers.Dense(256, activation="relu", name="hidden1")(x)
    x = tnt.keras.layers.SplitLayer(name="end_of_stage0")(x)  # stage 0 above, stage 1 below
    x = keras.layers.Dense(128, activation="relu", name="hidden2")(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="classes")(x)
    return keras.Model(inputs, outputs, name="digits_mlp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--all", action="store_true", help="pipelines as data-parallel replicas (N = 2k)")
    parser.add_argument("--seed", type=int, default=1234, help="initial weights and Keras' other random draws")
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_digits()
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=7)
    train = train.batch(args.batch_size)
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.batch_size)

    strategy = tnt.ParallelStrategy.ALL if args.all else tnt.ParallelStrategy.PIPELINING
    with tnt.pipelining.deferred_variables():
        keras_model = mlp()
    model = tnt.Model(keras_model, parallel_strategy=strategy, num_micro_batches=args.micro_batches,
                      pipeline_schedule="1f1b")
    model.summary()  # the pipeline plan (stages, layers, boundary tensors) on the master
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit(train, epochs=args.epochs, validation_data=test, verbose=2)
    loss, accuracy = model.evaluate(test, verbose=0)
    if tnt.is_master_rank():
        print(f"ranks: {tnt.get_size()}  test loss: {loss:.4f}  test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
