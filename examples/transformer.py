"""A small encoder-decoder Transformer learns to reverse sequences, data-parallel with Tarantella.

    tarantella -n 2 -- examples/transformer.py
    python examples/transformer.py                 # the same on 1 rank

As in the original Tarantella Transformer tutorial:

- the dataset is distributed by hand: every rank generates the same samples, keeps its
  shard (`Dataset.shard(size, rank)`), batches it with its micro-batch size and passes
  `tnt_distribute_dataset=False` to `fit` — Tarantella then trains on what each rank is
  given (gradients are still weighted by the ranks' sample counts);
- after training, a separate serial inference model (encoder once, then the decoder one
  token at a time, greedy) is built from the same layers, so it shares the trained
  weights; it runs on the master rank only, as plain Keras.

The task is generated, not downloaded: reverse a random sequence of tokens. The printed
score is the fraction of target tokens the greedy decoder gets right.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt

BOS = 0  # start-of-sequence token fed to the decoder; source tokens are 1 .. vocab-1


def reverse_task(samples: int, length: int, vocab: int, seed: int):
    """(source, decoder input, target): target is the source reversed; decoder input is
    the target shifted right behind BOS (teacher forcing)."""
    source = np.random.default_rng(seed).integers(1, vocab, size=(samples, length)).astype("int32")
    target = source[:, ::-1].copy()
    decoder_in = np.concatenate([np.full((samples, 1), BOS, "int32"), target[:, :-1]], axis=1)
    return source, decoder_in, target


class PositionalEmbedding(keras.layers.Layer):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocab: int, length: int, width: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocab, width)
        self.positions = keras.layers.Embedding(length, width)

    def call(self, ids):
        return self.tokens(ids) + self.positions(keras.ops.arange(keras.ops.shape(ids)[-1]))


class EncoderBlock(keras.layers.Layer):
    """Self-attention then a feed-forward network, each with a residual and LayerNorm."""

    def __init__(self, width: int, heads: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(heads, width // heads)
        self.ffn = keras.Sequential([keras.layers.Dense(2 * width, activation="relu"), keras.layers.Dense(width)])
        self.norm1, self.norm2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()

    def call(self, x):
        x = self.norm1(x + self.attention(x, x))
        return self.norm2(x + self.ffn(x))


class DecoderBlock(keras.layers.Layer):
    """Causal self-attention, attention over the encoder's output, then a feed-forward network."""

    def __init__(self, width: int, heads: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.self_attention = keras.layers.MultiHeadAttention(heads, width // heads)
        self.cross_attention = keras.layers.MultiHeadAttention(heads, width // heads)
        self.ffn = keras.Sequential([keras.layers.Dense(2 * width, activation="relu"), keras.layers.Dense(width)])
        self.norms = [keras.layers.LayerNormalization() for _ in range(3)]

    def call(self, x, memory):
        x = self.norms[0](x + self.self_attention(x, x, use_causal_mask=True))
        x = self.norms[1](x + self.cross_attention(x, memory))
        return self.norms[2](x + self.ffn(x))


def build(length: int, vocab: int, width: int, heads: int):
    """The training model and, sharing its layers (and so its weights), the inference parts."""
    source = keras.Input((length,), dtype="int32", name="source")
    decoder_in = keras.Input((length,), dtype="int32", name="decoder_in")
    memory_in = keras.Input((length, width), name="memory")

    encoder_embed = PositionalEmbedding(vocab, length, width)
    decoder_embed = PositionalEmbedding(vocab, length, width)
    encoder_block, decoder_block = EncoderBlock(width, heads), DecoderBlock(width, heads)
    to_logits = keras.layers.Dense(vocab)

    memory = encoder_block(encoder_embed(source))
    logits = to_logits(decoder_block(decoder_embed(decoder_in), memory))
    training_model = keras.Model([source, decoder_in], logits, name="transformer")

    encoder = keras.Model(source, memory, name="encoder")
    decoder = keras.Model(
        [memory_in, decoder_in], to_logits(decoder_block(decoder_embed(decoder_in), memory_in)), name="decoder"
    )
    return training_model, encoder, decoder


def greedy_decode(encoder: keras.Model, decoder: keras.Model, source: np.ndarray) -> np.ndarray:
    """Serial inference: encode once, then emit one token per step from the decoder."""
    memory = encoder.predict_on_batch(source)
    tokens = np.full_like(source, BOS)  # decoder input; position i+1 gets the token emitted at i
    out = np.zeros_like(source)
    for i in range(source.shape[1]):
        # The causal mask makes the logits at position i depend only on tokens[:, : i + 1].
        out[:, i] = np.argmax(decoder.predict_on_batch([memory, tokens])[:, i], axis=-1)
        if i + 1 < source.shape[1]:
            tokens[:, i + 1] = out[:, i]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8, help="tokens per sequence")
    parser.add_argument("--vocab", type=int, default=12)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8192, help="training sequences")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=3, help="initial weights and Keras' other random draws")
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)
    rank, size = tnt.get_rank(), tnt.get_size()
    if args.batch_size % size:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {size} ranks")
    micro_batch = args.batch_size // size

    source, decoder_in, target = reverse_task(args.samples, args.length, args.vocab, seed=1)
    train = (
        tf.data.Dataset.from_tensor_slices(((source, decoder_in), target))
        .shuffle(args.samples, seed=5)  # the same order on every rank, then each keeps its shard
        .shard(num_shards=size, index=rank)
        .batch(micro_batch, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )

    training_model, encoder, decoder = build(args.length, args.vocab, args.width, args.heads)
    model = tnt.Model(training_model)
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(train, epochs=args.epochs, tnt_distribute_dataset=False, verbose=2)

    if tnt.is_master_rank():
        test_source, _, test_target = reverse_task(512, args.length, args.vocab, seed=2)
        decoded = greedy_decode(encoder, decoder, test_source)
        token_accuracy = float(np.mean(decoded == test_target))
        exact = float(np.mean(np.all(decoded == test_target, axis=1)))
        print(
            f"ranks: {size}  train loss: {history.history['loss'][-1]:.4f}  "
            f"greedy token accuracy: {token_accuracy:.4f}  exact sequences: {exact:.4f}"
        )


if __name__ == "__main__":
    main()
