"""Bad-input job (docs/errors.md): every misuse that needs ranks gives its error on every
rank, with a message naming the fix, and leaves the job usable; legal corner cases work.

Each check records (ok, detail) per rank; the results of all ranks are gathered and
rank 0 writes them. The job itself finishing proves that nothing hung.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import _job
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

CHECKS: dict[str, dict] = {}


def check(name: str, ok: bool, detail: object = "") -> None:
    everyone = tnt_comm.allgather_object((bool(ok), str(detail)[:1500]))
    CHECKS[name] = {"ok": all(o for o, _ in everyone),
                    "detail": {f"rank {r}": d for r, (_, d) in enumerate(everyone)}}


def expect_error(name: str, exc: type, fragments: list[str], fn) -> None:
    try:
        fn()
    except exc as err:
        message = str(err)
        missing = [f for f in fragments if f not in message]
        check(name, not missing, f"missing {missing} in: {message}" if missing else message)
    except Exception as err:
        check(name, False, f"{type(err).__name__}: {err}")
    else:
        check(name, False, "no error raised")


def net(seed: int = 5, width: int = 12) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])


def compiled(model, optimizer=None):
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def data(n: int = 40, seed: int = 1):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n).astype("int32")
    x = (rng.normal(size=(n, 8)) + y[:, None] * 0.4).astype("float32")
    return x, y


X, Y = data()


def ds(batch: int, x=X, y=Y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def serial_vs_tnt(batch: int, optimizer_factory=lambda: keras.optimizers.SGD(0.05), epochs: int = 2):
    serial, model = compiled(net(), optimizer_factory()), compiled(tnt.Model(net()), optimizer_factory())
    hs = serial.fit(ds(batch), epochs=epochs, verbose=0).history
    ht = model.fit(ds(batch), epochs=epochs, verbose=0).history
    d = dict(history=_job.history_diff(hs, ht),
             weights=_job.max_abs_diff(serial.get_weights(), model.get_weights()),
             evaluate=_job.max_abs_diff(serial.evaluate(ds(batch), verbose=0), model.evaluate(ds(batch), verbose=0)),
             predict=_job.max_abs_diff(serial.predict(ds(batch).map(lambda a, b: a), verbose=0),
                                       model.predict(ds(batch).map(lambda a, b: a), verbose=0)))
    return d


def check_legal_corner_cases() -> None:
    # Global batch 1 < number of ranks: other ranks get empty micro-batches; serial result.
    d = serial_vs_tnt(batch=1, epochs=1)
    check("global_batch_smaller_than_ranks_works", max(d.values()) < 1e-5, d)
    d = serial_vs_tnt(batch=8, optimizer_factory=lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01))
    check("ftrl_supported", max(d.values()) < 1e-5, d)


def check_input_errors() -> None:
    model = compiled(tnt.Model(net()))
    expect_error("error_micro_batch_inconsistent", tnt.InputError,
                 ["already batched with batch size 10", f"tnt_micro_batch_size=3 with size={tnt.get_size()}",
                  f"batch it with {3 * tnt.get_size()}", "drop tnt_micro_batch_size"],
                 lambda: model.fit(ds(10), tnt_micro_batch_size=3, verbose=0))
    expect_error("error_unbatched_without_micro_batch", tnt.InputError,
                 ["not batched", "dataset.batch(B)", "tnt_micro_batch_size="],
                 lambda: model.fit(tf.data.Dataset.from_tensor_slices((X, Y)), verbose=0))
    expect_error("error_batch_size_with_dataset", tnt.InputError, ["double batching", "drop batch_size="],
                 lambda: model.fit(ds(10), batch_size=10, verbose=0))
    # Generators are split (tests/test_inputs.py); their batches are global: no batch_size=.
    expect_error("error_generator_input", tnt.InputError,
                 ["batch_size= cannot be passed with a generator", "global batches", "Drop it"],
                 lambda: model.fit((b for b in [(X, Y)]), batch_size=10, verbose=0))
    expect_error("error_fit_before_compile", RuntimeError, ["needs a compiled model", "model.compile("],
                 lambda: tnt.Model(net()).fit(ds(10), verbose=0))
    expect_error("error_validation_split_with_dataset", tnt.InputError, ["validation_split needs arrays", "validation_data="],
                 lambda: model.fit(ds(10), validation_split=0.2, verbose=0))
    expect_error("error_predict_not_distributed", tnt.InputError, ["self.model.predict(...)"],
                 lambda: model.predict(ds(10).map(lambda a, b: a), tnt_distribute_dataset=False, verbose=0))
    # Different lengths per rank (each rank brings its own data, so tnt does not split it).
    mine = ds(10, *data(40 + 10 * tnt.get_rank(), seed=tnt.get_rank()))
    per_rank = ", ".join(f"rank {r}: {4 + r}" for r in range(tnt.get_size()))
    expect_error("error_dataset_lengths_differ", tnt.InputError,
                 ["different numbers of batches", per_rank, "tnt_distribute_dataset=False"],
                 lambda: model.fit(mine, tnt_distribute_dataset=False, verbose=0))
    expect_error("error_dataset_lengths_differ_evaluate", tnt.InputError, ["different numbers of batches", per_rank],
                 lambda: model.evaluate(mine, tnt_distribute_dataset=False, verbose=0))
    # Same lengths with own data per rank is legal.
    same = ds(10, *data(40, seed=tnt.get_rank()))
    h = model.fit(same, tnt_distribute_dataset=False, epochs=1, verbose=0).history
    check("own_data_per_rank_same_length_trains", np.isfinite(h["loss"][0]), h)


def check_uncompiled_loaded(tmp: Path) -> None:
    model = compiled(tnt.Model(net()))
    model.fit(ds(10), verbose=0)
    model.save(tmp / "m.keras")
    loaded = tnt.models.load_model(tmp / "m.keras", compile=False)
    expect_error("error_uncompiled_loaded_model", RuntimeError, ["compile=False", "compiled after loading"],
                 lambda: loaded.fit(ds(10), verbose=0))


def check_models_differ() -> None:
    # Width depends on the rank: detected at the first broadcast (wrapping a built
    # model), on every rank.
    expect_error("error_models_differ_shape", tnt.ReplicaMismatchError,
                 ["The model differs between ranks", "on rank 1 but", "on rank 0"],
                 lambda: compiled(tnt.Model(net(width=12 + tnt.get_rank()))).fit(ds(10), verbose=0))
    # A layer more on the last rank.
    layers = [keras.Input((8,)), keras.layers.Dense(12)]
    if tnt.get_rank() == tnt.get_size() - 1:
        layers.append(keras.layers.Dense(12))
    layers.append(keras.layers.Dense(3, activation="softmax"))
    keras.utils.set_random_seed(1)
    expect_error("error_models_differ_layers", tnt.ReplicaMismatchError,
                 ["The model differs between ranks", f"rank {tnt.get_size() - 1} has 6 variables, rank 0 has 4"],
                 lambda: compiled(tnt.Model(keras.Sequential(layers))).fit(ds(10), verbose=0))
    # Auto-generated names differ (the master built a serial reference first): the stages'
    # plans differ, and every rank raises, naming the fix (before: stage 1 raised, stage 0
    # waited in its next collective until the comm timeout).
    if tnt.is_master_rank():
        net(), net()
    keras.utils.set_random_seed(2)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(12)(keras.layers.Dense(12)(inputs))
    auto_named = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    expect_error("error_pipeline_plans_differ_by_auto_names", tnt.pipelining.PipelineError,
                 ["the pipeline stages computed different plans", "Build the model to wrap first on every rank"],
                 lambda: tnt.Model(auto_named, parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                                   num_pipeline_stages=2))
    # The job goes on: collectives still match after all these errors.
    h = compiled(tnt.Model(net())).fit(ds(10), epochs=1, verbose=0).history
    check("usable_after_errors", np.isfinite(h["loss"][0]), h)


def main() -> None:
    out = _job.out_path()
    with tempfile.TemporaryDirectory() as local:
        shared = Path(tnt_comm.broadcast_object(local, 0))
        check_legal_corner_cases()
        check_input_errors()
        check_uncompiled_loaded(shared)
        check_models_differ()
        tnt_comm.barrier()
        _job.write(out, {"ranks": tnt.get_size(), "checks": CHECKS})


if __name__ == "__main__":
    main()
