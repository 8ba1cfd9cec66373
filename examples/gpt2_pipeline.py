"""A keras-hub GPT-2 language model trained on 2 ranks, cut into pipeline stages or with
its layers split (layer parallelism).

    tarantella -n 2 -- examples/gpt2_pipeline.py                      # PIPELINING: 2 stages
    tarantella -n 2 -- examples/gpt2_pipeline.py --strategy tensor    # TENSOR: 2 shards
    python examples/gpt2_pipeline.py                                  # one rank: plain data parallelism

The model is keras-hub's `GPT2CausalLM` built from constructor arguments (a small GPT-2:
no download, no tokenizer), exactly as a user writes it for serial Keras; the only change
is `tnt.Model(model, parallel_strategy=..., ...)`. Under PIPELINING the automatic partition
cuts through the backbone's Transformer layers and the token embedding, tied to the output
projection, stays one weight (the last stage's copy receives its gradient from the first
stage's every step). Under TENSOR each rank holds half of every attention and feed-forward
layer and of the embedding table.

The text is generated: every sequence counts upward from a random token (wrapping at the
vocabulary size), so the next token is always the current one plus one; a model that has
learned it predicts almost every token.
"""

from __future__ import annotations

import argparse

import keras
import keras_hub
import numpy as np

import tarantella as tnt

STRATEGIES = {
    "pipelining": dict(parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_micro_batches=4),
    "tensor": dict(parallel_strategy=tnt.ParallelStrategy.TENSOR),
}


def counting(samples: int, length: int, vocab: int, seed: int):
    """Inputs (token ids and padding mask) and next-token labels of counting sequences."""
    start = np.random.default_rng(seed).integers(0, vocab, size=(samples, 1))
    tokens = (start + np.arange(length + 1)) % vocab
    x = {"token_ids": tokens[:, :-1].astype("int32"), "padding_mask": np.ones((samples, length), "int32")}
    return x, tokens[:, 1:].astype("int32")


def gpt2(vocab: int, length: int, width: int, layers: int) -> keras.Model:
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocab, num_layers=layers, num_heads=2,
                                             hidden_dim=width, intermediate_dim=4 * width,
                                             max_sequence_length=length, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="pipelining")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--length", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=32, help="hidden size")
    parser.add_argument("--layers", type=int, default=2, help="Transformer layers")
    parser.add_argument("--samples", type=int, default=1024, help="training sequences")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234, help="initial weights and Keras' other random draws")
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)
    x_train, y_train = counting(args.samples, args.length, args.vocab, seed=1)
    x_test, y_test = counting(256, args.length, args.vocab, seed=2)

    options = dict(STRATEGIES[args.strategy]) if tnt.get_size() > 1 else {}
    if args.strategy == "pipelining" and options:
        options["num_pipeline_stages"] = tnt.get_size()
    if args.strategy == "tensor" and options:
        options["tensor_parallel_size"] = tnt.get_size()
    model = tnt.Model(gpt2(args.vocab, args.length, args.width, args.layers), **options)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["sparse_categorical_accuracy"])
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
    result = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0, return_dict=True)
    if tnt.is_master_rank():
        print(f"strategy: {args.strategy}  ranks: {tnt.get_size()}  test loss: {result['loss']:.4f}  "
              f"next-token accuracy: {result['sparse_categorical_accuracy']:.4f}")


if __name__ == "__main__":
    main()
