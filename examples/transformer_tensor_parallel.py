"""A small Transformer encoder classifier with its layers split over 2 ranks (layer parallelism).

    tarantella -n 2 -- examples/transformer_tensor_parallel.py
    python examples/transformer_tensor_parallel.py          # t = 1: the same model on one rank

Every rank holds half of each split layer: the token embedding by vocabulary rows, each
attention layer by heads (2 of 4 per rank), each feed-forward pair as a column-split then a
row-split Dense (the Dropout between them draws the serial mask and keeps its columns);
LayerNorms, residual additions and the small classifier head are replicated. Compared
with a serial Keras script: `import tarantella as tnt` and
`tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.TENSOR, tensor_parallel_size=t)`.
Every rank reads the same global batches (a tensor group splits layers, not data).

The task is generated, not downloaded: a sequence's class is the token range ("topic")
most of its tokens come from; the rest of its tokens are noise from the whole vocabulary.
With `--save PATH` the trained model is written as one ordinary Keras file (the master
joins the shards), which `keras.saving.load_model` opens, and
`tnt.models.load_model(PATH, parallel_strategy=tnt.ParallelStrategy.TENSOR,
tensor_parallel_size=q)` splits again over any q.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np

import tarantella as tnt


def topics(samples: int, length: int, vocab: int, classes: int, seed: int):
    """Token ids and labels: 60 % of a sequence's tokens come from its class's range."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=samples)
    width = vocab // classes
    on_topic = labels[:, None] * width + rng.integers(0, width, size=(samples, length))
    noise = rng.integers(0, vocab, size=(samples, length))
    tokens = np.where(rng.random((samples, length)) < 0.6, on_topic, noise)
    return tokens.astype("int32"), labels.astype("int32")


def encoder_block(x, width: int, heads: int, index: int):
    """Self-attention, then a feed-forward pair, each with a residual and LayerNorm."""
    attention = keras.layers.MultiHeadAttention(heads, width // heads, dropout=0.1, name=f"attention{index}")(x, x)
    x = keras.layers.LayerNormalization(name=f"norm{index}a")(keras.layers.Add()([x, attention]))
    h = keras.layers.Dense(4 * width, activation="relu", name=f"ffn{index}_up")(x)
    h = keras.layers.Dropout(0.1, name=f"ffn{index}_dropout")(h)
    h = keras.layers.Dense(width, name=f"ffn{index}_down")(h)
    return keras.layers.LayerNormalization(name=f"norm{index}b")(keras.layers.Add()([x, h]))


def transformer(length: int, vocab: int, width: int, heads: int, blocks: int, classes: int) -> keras.Model:
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab, width, name="embedding")(tokens)
    for i in range(blocks):
        x = encoder_block(x, width, heads, i)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(classes, activation="softmax", name="classes")(x)
    return keras.Model(tokens, outputs, name="topic_transformer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4096, help="training sequences")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size (the same on every rank)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save", default=None, help="write the trained model to this .keras file")
    parser.add_argument("--seed", type=int, default=1234, help="initial weights and Keras' other random draws")
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)  # the same shuffles on every rank of the group
    classes = 4
    x_train, y_train = topics(args.samples, args.length, args.vocab, classes, seed=1)
    x_test, y_test = topics(512, args.length, args.vocab, classes, seed=2)

    keras_model = transformer(args.length, args.vocab, args.width, args.heads, args.blocks, classes)
    model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.TENSOR,
                      tensor_parallel_size=tnt.get_size())
    model.summary()  # the plan: which layer is split how, weights per rank (master only)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    if args.save:
        model.save(args.save)  # every rank takes part; the master writes
    if tnt.is_master_rank():
        print(f"ranks: {tnt.get_size()}  tensor_parallel_size: {model.tensor_parallel_size}  "
              f"test loss: {loss:.4f}  test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
