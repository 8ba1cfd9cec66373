"""Python inputs on N ranks against serial Keras, in one launch (tests/test_inputs.py).

The master runs the serial reference (plain Keras on an identical input object) and
broadcasts it; every rank runs the same with tnt.Model and compares History,
serial-shaped weights, evaluate and predict. Cases: a PyDataset with an uneven last batch
(smaller than N on 3 ranks), an ``on_epoch_end`` reshuffle and workers=2, loading a
rank's rows only (get_rows; every request recorded) for training and evaluate, whole
batches (__getitem__) for validation and predict; a generator with steps_per_epoch (and a
finite validation generator); a duck-typed DataLoader; a generator that yields other data
on rank 1 from batch 2 on (the error every rank must raise); a real torch DataLoader when
torch imports; on 2 ranks, the same inputs under PIPELINING and TENSOR.
"""

from __future__ import annotations

import math
import threading
import time

import _job
import keras
import numpy as np

import tarantella as tnt
import tnt_comm

B, N_TRAIN, N_VAL = 8, 42, 19  # last batches of 2 and 3 samples: fewer than 3 ranks
RANK, SIZE = tnt.get_rank(), tnt.get_size()
SplitLayer = tnt.keras.layers.SplitLayer


def arrays(seed: int, n: int):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int64")


class Batches(keras.utils.PyDataset):
    """Batches of ``batch`` rows in ``self.order``; ``on_epoch_end`` reshuffles the order
    (seeded) when ``reshuffle_seed``; counts the rows it loads and records each request as
    (batch, start, stop) (thread-safe: workers=2)."""

    def __init__(self, x, y, batch, reshuffle_seed=None, x_only=False, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch, self.x_only = x, y, batch, x_only
        self.rng = None if reshuffle_seed is None else np.random.default_rng(reshuffle_seed)
        self.order = np.arange(len(x))
        self.lock = threading.Lock()
        self.loaded, self.calls = 0, set()

    def __len__(self):
        return math.ceil(len(self.x) / self.batch)

    def _load(self, idx, call):
        with self.lock:
            self.loaded += len(idx)
            self.calls.add(call)
        return self.x[idx] if self.x_only else (self.x[idx], self.y[idx])

    def __getitem__(self, i):
        return self._load(self.order[i * self.batch:(i + 1) * self.batch], (int(i), 0, len(self.x)))

    def on_epoch_end(self):
        if self.rng is not None:
            self.rng.shuffle(self.order)


class RowBatches(Batches):
    """The same, able to load rows start..stop-1 of batch i alone."""

    def num_rows(self, i):
        return min(self.batch, len(self.x) - i * self.batch)

    def get_rows(self, i, start, stop):
        return self._load(self.order[i * self.batch + start:i * self.batch + stop], (int(i), int(start), int(stop)))


def generator(seed: int, batches: int | None, x_only=False, differ_on=None):
    """Seeded batches of 7 samples (uneven on 2 and 3 ranks); ``differ_on=(rank, k)``:
    that rank's batches from k on are shifted."""
    rng = np.random.default_rng(seed)
    k = 0
    while batches is None or k < batches:
        x = rng.normal(size=(7, 6)).astype("float32")
        y = rng.integers(0, 3, 7).astype("int64")
        if differ_on is not None and RANK == differ_on[0] and k >= differ_on[1]:
            x = x + 1.0
        yield (x,) if x_only else (x, y)
        k += 1


class LoaderLike:
    """Duck-typed torch DataLoader (the names Keras and tnt look for), re-iterable, with a length."""

    def __init__(self, x, y, batch):
        self.x, self.y, self.batch = x, y, batch
        self.dataset = x  # a DataLoader's dataset: its length gives the loader's

    def __len__(self):
        return math.ceil(len(self.x) / self.batch)

    def __iter__(self):
        for i in range(len(self)):
            yield self.x[i * self.batch:(i + 1) * self.batch], self.y[i * self.batch:(i + 1) * self.batch]


LoaderLike.__name__ = "DataLoader"
LoaderLike.__module__ = "torch.utils.data.dataloader"


def mlp(seed: int = 3, split: bool = False) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = inp = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu", name="d0")(x)
    if split:
        x = SplitLayer(name="cut")(x)
    x = keras.layers.Dense(8, activation="tanh", name="d1")(x)
    return keras.Model(inp, keras.layers.Dense(3, activation="softmax", name="out")(x))


def compile_(m):
    m.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def compare(serial_run, tnt_run, make=mlp, **model_args) -> dict:
    """Run ``serial_run(model)`` on plain Keras (on the master, its results broadcast) and
    ``tnt_run(model)`` on tnt.Model; both return (history, evaluate, predict)."""
    def reference():
        serial = compile_(make())
        return (*serial_run(serial), serial.get_weights())

    h_s, e_s, p_s, w_s = tnt_comm.broadcast_object(reference() if RANK == 0 else None, 0)
    model = compile_(tnt.Model(make(), **model_args))
    t0 = time.perf_counter()
    h_t, e_t, p_t = tnt_run(model)
    weights = model.get_weights()
    digest = [float(np.sum(w)) for w in weights]
    return {
        "history_diff": _job.history_diff(h_s, h_t),
        "weight_diff": _job.max_abs_diff(w_s, weights),
        "evaluate_diff": _job.max_abs_diff(e_s, e_t),
        "predict_diff": _job.max_abs_diff(p_s, p_t),
        "predict_rows": [int(np.shape(p_s)[0]), int(np.shape(p_t)[0])],
        "history_keys": [sorted(h_s), sorted(h_t)],
        "epochs": len(next(iter(h_t.values()))),
        "same_on_ranks": len({repr(d) for d in tnt_comm.allgather_object((digest, h_t))}) == 1,
        "seconds": time.perf_counter() - t0,
    }


def case_pydataset() -> dict:
    """Training batches loaded by rows (get_rows) with workers=2 and an on_epoch_end
    reshuffle; validation and predict through __getitem__; evaluate by rows again."""
    x, y = arrays(1, N_TRAIN)
    vx, vy = arrays(2, N_VAL)
    used = {}

    def run(m):
        train = RowBatches(x, y, B, reshuffle_seed=4, workers=2)
        val = RowBatches(vx, vy, 7, reshuffle_seed=6, workers=2)
        h = m.fit(train, epochs=3, shuffle=False, verbose=0,
                  validation_data=Batches(vx, vy, B, reshuffle_seed=5)).history
        e = m.evaluate(val, verbose=0)
        p = m.predict(Batches(vx, vy, 7, x_only=True, workers=2), verbose=0)
        used["tnt" if isinstance(m, tnt.Model) else "serial"] = (train.loaded, sorted(train.calls),
                                                                  val.loaded, sorted(val.calls))
        return h, e, p

    out = compare(run, run)
    serial = tnt_comm.broadcast_object(used.get("serial"), 0)
    out["serial_loaded"] = [serial[0], serial[2]]
    per_rank = tnt_comm.allgather_object(used["tnt"])
    out["rank_loaded"] = [[p[0], p[2]] for p in per_rank]
    out["rank_calls"] = [[p[1], p[3]] for p in per_rank]
    return out


def case_generator() -> dict:
    def run(m):
        h = m.fit(generator(7, None), steps_per_epoch=4, epochs=2, verbose=0,
                  validation_data=generator(8, 3)).history
        e = m.evaluate(generator(9, 3), verbose=0)
        p = m.predict(generator(10, 3, x_only=True), verbose=0)
        return h, e, p

    return compare(run, run)


def case_loader_like() -> dict:
    x, y = arrays(13, N_TRAIN)

    def serial(m):
        h = m.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
        return h, m.evaluate(x, y, batch_size=B, verbose=0), m.predict(x, batch_size=B, verbose=0)

    def run(m):
        loader = LoaderLike(x, y, B)
        h = m.fit(loader, epochs=2, verbose=0).history
        return h, m.evaluate(loader, verbose=0), m.predict(LoaderLike(x, y, B), verbose=0)

    return compare(serial, run)


def case_torch() -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not importable"}
    x, y = arrays(14, N_TRAIN)
    data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    def run(m):
        torch.manual_seed(0)
        loader = torch.utils.data.DataLoader(data, batch_size=B, shuffle=True)
        h = m.fit(loader, epochs=2, verbose=0).history
        e = m.evaluate(torch.utils.data.DataLoader(data, batch_size=B), verbose=0)
        return h, e, m.predict(torch.utils.data.DataLoader(data, batch_size=B), verbose=0)

    return compare(run, run)


def case_mismatch() -> dict:
    model = compile_(tnt.Model(mlp()))
    started = time.perf_counter()
    try:
        model.fit(generator(15, None, differ_on=(1, 2)), steps_per_epoch=5, epochs=1, verbose=0)
        mine = ("no error", "")
    except Exception as err:
        mine = (type(err).__name__, str(err))
    return {"errors": tnt_comm.allgather_object(mine), "seconds": time.perf_counter() - started}


def case_pipelining() -> dict:
    x, y = arrays(16, N_TRAIN)
    vx, vy = arrays(17, N_VAL)

    def run(m):
        h = m.fit(Batches(x, y, B, reshuffle_seed=4, workers=2), epochs=2, shuffle=False, verbose=0,
                  validation_data=generator(18, 2)).history
        return h, m.evaluate(RowBatches(vx, vy, 7), verbose=0), m.predict(generator(19, 3, x_only=True), verbose=0)

    return compare(run, run, make=lambda: mlp(split=True), parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                   num_pipeline_stages=SIZE, num_micro_batches=2)


def case_tensor() -> dict:
    x, y = arrays(20, N_TRAIN)
    vx, vy = arrays(21, N_VAL)

    def run(m):
        h = m.fit(Batches(x, y, B, reshuffle_seed=4, workers=2), epochs=2, shuffle=False, verbose=0,
                  validation_data=generator(22, 2)).history
        return h, m.evaluate(RowBatches(vx, vy, 7), verbose=0), m.predict(generator(23, 3, x_only=True), verbose=0)

    return compare(run, run, parallel_strategy=tnt.ParallelStrategy.TENSOR, tensor_parallel_size=SIZE)


CASES = {"pydataset": case_pydataset, "generator": case_generator, "loader_like": case_loader_like, "torch": case_torch, "pipelining": case_pipelining,
         "tensor": case_tensor, "mismatch": case_mismatch}

if __name__ == "__main__":
    out = _job.out_path()
    names = _job.only([n for n in CASES if SIZE == 2 or n not in ("loader_like", "pipelining", "tensor")])
    results = {}
    for name in names:
        t0 = time.perf_counter()
        results[name] = CASES[name]()
        results[name]["case_seconds"] = time.perf_counter() - t0
    _job.write(out, {"ranks": SIZE, "cases": results})
