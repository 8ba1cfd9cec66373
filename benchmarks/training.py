"""Training throughput: tnt.Model vs plain Keras, weak scaling, the mpi4py peer, fusion sweep.

    python benchmarks/training.py overhead [--quick]              # 1 process
    mpirun -n 2 python benchmarks/training.py scaling [--quick]   # N ranks

``overhead`` (1 rank): samples/s of ``tnt.Model(m).fit`` vs plain Keras ``m.fit`` on the
same data, model and threads, for LeNet-5 and ResNet-20, timed round-robin (Keras E
epochs, tnt E epochs, repeated R times after a warm-up epoch each). The ratio is the
median of the per-round ratios. Writes results/training_overhead.json.

``scaling`` (N ranks, fixed micro-batch per rank, 1 intra-op + 1 inter-op thread per
rank), ResNet-20, contenders timed round-robin in the same processes:

* ``tnt@<KB>``: ``tnt.Model`` with ``TNT_FUSION_THRESHOLD=<KB>`` (0, 32, 1024, 8192, 65536);
  the engine's ``wait`` and ``submit`` are timed (by wrapping the public
  ``tnt_comm.FusedAllreduce`` class; tnt-keras is unchanged), giving the fraction of the
  step spent waiting for communication;
* ``mpi4py_naive``: a custom loop, gradients allreduced one tensor at a time with blocking
  mpi4py ``Allreduce`` after backprop (no fusion, no overlap);
* ``tnt_nocomm``: ``tnt.Model`` whose engine is swapped for one that exchanges nothing
  (each rank keeps its own gradients): tnt's distributed step graph without the
  communication and without waiting for the other rank — the split of tnt's cost into
  graph overhead (vs keras_independent) and communication + synchronisation (vs tnt);
* ``tnt_syncbn``: ``tnt.Model(m, sync_batch_norm=True)``: batch statistics over the global
  batch (two in-graph allreduces per BatchNormalization layer forward, two backward);
* ``keras_independent``: every rank runs plain Keras on its micro-batches, no
  communication: what this machine delivers with N busy ranks (the hardware ceiling);
  its step times give the lockstep ceiling, over all rounds and of each round alone
  (``lockstep_ceiling_per_round``, which summary.py divides the same round's ratio by);
* ``keras_alone``: rank 0 runs plain Keras while the others sleep: 1-rank compute speed
  measured inside the same job;
* ``mwms``: tf.distribute.MultiWorkerMirroredStrategy, set up in the same processes with
  TF_CONFIG on free localhost ports (created before any TensorFlow op); Keras 3 is tried
  and its error recorded, then tf_keras trains (see peer_mwms.py for the same peer in
  processes of its own); ``tf_keras_independent`` is its ceiling (tf_keras, no
  communication), as tf_keras and Keras 3 differ in speed on their own.

Ratios against tnt (``tnt_over_this``) are medians of per-round ratios.

Plus the floor of the gradient exchange: one contiguous MPI_Allreduce and one memcpy of
the same bytes. Writes results/training_scaling_<N>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import benchlib as bl  # first: pins threads before TensorFlow starts
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_comm

bl.pin_threads(tf)

SWEEP_KB = (0, 32, 1024, 8192, 65536)
DEFAULT_KB = 8192  # tnt-keras' default TNT_FUSION_THRESHOLD (docs/keras.md)


# -- timing the engine from outside ----------------------------------------------------
class EngineClock:
    """Seconds spent in FusedAllreduce.wait/submit since the last reset (all engines)."""

    wait_s = 0.0
    submit_s = 0.0
    waits = 0
    last_buckets = 0  # buckets of the engine constructed last

    @classmethod
    def reset(cls) -> None:
        cls.wait_s = cls.submit_s = 0.0
        cls.waits = 0


class TimedFusedAllreduce(tnt_comm.FusedAllreduce):
    """tnt_comm's engine with the two calls tnt-keras makes timed; behaviour unchanged."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        EngineClock.last_buckets = len(self.plan)

    def submit_many(self, indices, arrays) -> None:
        t0 = time.perf_counter()
        super().submit_many(indices, arrays)
        EngineClock.submit_s += time.perf_counter() - t0

    def wait_buckets(self):
        t0 = time.perf_counter()
        out = super().wait_buckets()
        EngineClock.wait_s += time.perf_counter() - t0
        EngineClock.waits += 1
        return out


class NoCommEngine(bl.NoCommEngine):
    """benchlib's engine that communicates nothing, with EngineClock's counters: it
    isolates the step graph's own cost (masking, metric states, submit/wait ops) from the
    communication's. Instrumentation only; the numbers it trains are wrong."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        EngineClock.last_buckets = len(self.plan)

    def submit_many(self, indices, arrays) -> None:
        t0 = time.perf_counter()
        super().submit_many(indices, arrays)
        EngineClock.submit_s += time.perf_counter() - t0

    def wait_buckets(self):
        out = super().wait_buckets()
        EngineClock.waits += 1
        return out


_REAL_ENGINE = tnt_comm.FusedAllreduce
NO_COMM = False  # set while a "tnt_nocomm" contender builds its reducer (first fit)


def _engine(*args, **kwargs):
    return NoCommEngine(*args, **kwargs) if NO_COMM else TimedFusedAllreduce(*args, **kwargs)


tnt_comm.FusedAllreduce = _engine  # tnt-keras looks it up when building a reducer


def engine_timer():
    """Callback recording per epoch: seconds, engine wait seconds, submit seconds."""

    class _T(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[float, float, float, int]] = []
            self._t0 = 0.0

        def on_epoch_begin(self, epoch, logs=None):
            EngineClock.reset()
            self._t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.rows.append((time.perf_counter() - self._t0, EngineClock.wait_s,
                              EngineClock.submit_s, EngineClock.waits))

    return _T()


# -- contenders --------------------------------------------------------------------------
def fresh_keras(name: str, weights=None) -> keras.Model:
    m = bl.build(keras, name)
    if weights is not None:
        m.set_weights(weights)
    bl.compile_model(m)
    return m


class Contender:
    """Something that trains ``epochs`` epochs and returns (epoch seconds, extras) lists."""

    name = ""
    samples_per_epoch = 0

    def run(self, epochs: int) -> list[dict]:
        raise NotImplementedError


class KerasFit(Contender):
    """Plain ``model.fit`` on this rank; ``kmod`` is Keras 3 or the legacy tf_keras."""

    def __init__(self, name: str, model_name: str, ds: tf.data.Dataset, samples: int, weights,
                 active: bool = True, kmod=keras, step_times: bool = False) -> None:
        self.name, self.ds, self.samples_per_epoch = name, ds, samples
        self.step_times = step_times
        if kmod is keras:
            self.model = fresh_keras(model_name, weights)
        else:
            self.model = bl.build(kmod, model_name)
            bl.compile_model(self.model)
        self.active, self.kmod = active, kmod

    def run(self, epochs: int) -> list[dict]:
        tnt_comm.barrier()
        rows = []
        if self.active:
            timer = bl.EpochTimer.make(self.kmod, steps=self.step_times)
            self.model.fit(self.ds, epochs=epochs, verbose=0, callbacks=[timer])
            rows = [{"seconds": s, "step_seconds": st} for s, st in zip(timer.seconds, timer.step_seconds)]
        tnt_comm.barrier()  # sleeps (no busy-wait) on ranks that are not active
        return rows


class TntFit(Contender):
    def __init__(self, name: str, model_name: str, ds: tf.data.Dataset, samples: int, weights,
                 threshold_kb: int | None = None, no_comm: bool = False, sync_bn: bool = False) -> None:
        self.name, self.ds, self.samples_per_epoch = name, ds, samples
        self.no_comm = no_comm
        if threshold_kb is not None:
            os.environ["TNT_FUSION_THRESHOLD"] = str(threshold_kb)
        self.model = tnt.Model(bl.build(keras, model_name), sync_batch_norm=sync_bn)
        os.environ.pop("TNT_FUSION_THRESHOLD", None)
        if weights is not None:
            self.model.set_weights(weights)
        bl.compile_model(self.model)

    def run(self, epochs: int) -> list[dict]:
        timer = engine_timer()
        global NO_COMM
        EngineClock.last_buckets = 0
        NO_COMM = self.no_comm
        try:
            self.model.fit(self.ds, epochs=epochs, verbose=0, callbacks=[timer])
        finally:
            NO_COMM = False
        self.buckets = EngineClock.last_buckets or getattr(self, "buckets", 0)
        return [{"seconds": s, "wait_s": w, "submit_s": sub, "waits": n}
                for s, w, sub, n in timer.rows]


class Mpi4pyNaive(Contender):
    """The loop a user writes in an afternoon: backprop, then one blocking Allreduce per tensor."""

    def __init__(self, model_name: str, ds: tf.data.Dataset, samples: int, weights, comm) -> None:
        self.name, self.ds, self.samples_per_epoch, self.comm = "mpi4py_naive", ds, samples, comm
        self.model = bl.build(keras, model_name)
        if weights is not None:
            self.model.set_weights(weights)
        for v in self.model.weights:  # start identical: broadcast rank 0's weights
            a = np.ascontiguousarray(v.numpy())
            comm.Bcast(a, root=0)
            v.assign(a)
        self.optimizer = keras.optimizers.SGD()
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.accuracy = keras.metrics.SparseCategoricalAccuracy()
        variables = self.model.trainable_variables

        @tf.function
        def grads(x, y):
            with tf.GradientTape() as tape:
                pred = self.model(x, training=True)
                loss = self.loss_fn(y, pred)
            self.accuracy.update_state(y, pred)
            return loss, tape.gradient(loss, variables)

        @tf.function
        def apply(gs):
            self.optimizer.apply_gradients(zip(gs, variables))

        self._grads, self._apply = grads, apply

    def step(self, x, y) -> None:
        from mpi4py import MPI

        _, gs = self._grads(x, y)
        reduced = []
        for g in gs:
            a = g.numpy()
            self.comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
            reduced.append(a / self.comm.size)
        self._apply(reduced)

    def run(self, epochs: int) -> list[dict]:
        rows = []
        for _ in range(epochs):
            t0 = time.perf_counter()
            for x, y in self.ds:
                self.step(x, y)
            rows.append({"seconds": time.perf_counter() - t0})
        return rows


class MwmsFit(Contender):
    """tf.distribute.MultiWorkerMirroredStrategy in the same processes (TF_CONFIG per rank).

    Keras 3 is tried first (a one-step fit); it fails with TF 2.21 / Keras 3.15, so the
    error is recorded and the legacy ``tf_keras`` package trains the same model.
    """

    def __init__(self, strategy, model_name: str, ds: tf.data.Dataset, samples: int) -> None:
        self.name, self.ds, self.samples_per_epoch = "mwms", ds, samples
        try:
            with strategy.scope():
                model = bl.build(keras, model_name)
                bl.compile_model(model)
            model.fit(ds.take(1), epochs=1, verbose=0)
            self.keras3, kmod = "ok", keras
        except Exception as err:  # recorded in the JSON; the legacy path runs
            self.keras3 = short_error(err)
            import tf_keras as kmod

            with strategy.scope():
                model = bl.build(kmod, model_name)
                bl.compile_model(model)
        self.kmod, self.model = kmod, model
        self.keras = f"{'keras' if kmod is keras else 'tf_keras'} {kmod.__version__}"

    def run(self, epochs: int) -> list[dict]:
        timer = bl.EpochTimer.make(self.kmod)
        self.model.fit(self.ds, epochs=epochs, verbose=0, callbacks=[timer])
        return [{"seconds": s} for s in timer.seconds]


def short_error(err: BaseException) -> str:
    """Type, first and last line of an error (the middle may be a whole tensor dump)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(err).__name__}: {text}"[:300]


def start_mwms(n: int):
    """Create the strategy (before any TensorFlow op): rank 0's free ports for all ranks."""
    import json as _json
    import socket

    ports = None
    if tnt.get_rank() == 0:
        socks = [socket.socket() for _ in range(n)]
        for sk in socks:
            sk.bind(("127.0.0.1", 0))
        ports = [sk.getsockname()[1] for sk in socks]
        for sk in socks:
            sk.close()
    ports = tnt_comm.broadcast_object(ports, 0)
    os.environ["TF_CONFIG"] = _json.dumps({
        "cluster": {"worker": [f"localhost:{p}" for p in ports]},
        "task": {"type": "worker", "index": tnt.get_rank()},
    })
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # only tf.keras reads it; Keras 3 is imported already
    return tf.distribute.MultiWorkerMirroredStrategy()


# -- measurement ---------------------------------------------------------------------------
def round_robin(contenders: list[Contender], rounds: int, epochs: int) -> dict[str, list[list[dict]]]:
    """Warm up each contender (1 epoch), then ``rounds`` x (each contender ``epochs`` epochs)."""
    for c in contenders:
        c.run(1)
    out: dict[str, list[list[dict]]] = {c.name: [] for c in contenders}
    for _ in range(rounds):
        for c in contenders:
            out[c.name].append(c.run(epochs))
    return out


def sps(rows: list[dict], samples: int) -> list[float]:
    return [samples / r["seconds"] for r in rows]


def overhead(args) -> dict:
    result = {"mode": "overhead", "ranks": tnt.get_size(), "machine_before": bl.machine(), "models": {}}
    for name in ("lenet5", "resnet"):
        cfg = bl.MODELS[name]
        steps = max(4, cfg["steps"] // (2 if args.quick else 1))
        ds = bl.dataset(tf, name, cfg["micro_batch"], steps)
        samples = cfg["micro_batch"] * steps
        weights = bl.build(keras, name).get_weights()
        contenders = [KerasFit("keras", name, ds, samples, weights),
                      TntFit("tnt", name, ds, samples, weights)]
        runs = round_robin(contenders, args.rounds, args.epochs)
        per_round = [bl.median(sps(t, samples)) / bl.median(sps(k, samples))
                     for k, t in zip(runs["keras"], runs["tnt"])]
        flat = {k: [r for rnd in v for r in rnd] for k, v in runs.items()}
        result["models"][name] = {
            "micro_batch": cfg["micro_batch"], "steps_per_epoch": steps,
            "params": int(contenders[0].model.count_params()),
            "keras_sps": bl.median(sps(flat["keras"], samples)),
            "tnt_sps": bl.median(sps(flat["tnt"], samples)),
            "ratio": bl.median(per_round),
            "ratio_per_round": per_round,
            "epochs": {k: [r["seconds"] for r in v] for k, v in flat.items()},
        }
    result["machine_after"] = bl.machine()
    return result


def timed(fn: Callable[[], object], comm, reps: int = 20, warmup: int = 3) -> list[float]:
    """The slowest rank's time of each of ``reps`` calls of ``fn`` (after a warm-up)."""
    from mpi4py import MPI

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return times


def gradient_floor(nbytes: int, comm) -> dict:
    """The physical floor of one gradient exchange: memcpy and one contiguous Allreduce.

    Medians, like every other time here; the minima are kept too, because under load a
    blocking MPI_Allreduce that busy-waits suffers most from being descheduled.
    """
    from mpi4py import MPI

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    copy = timed(lambda: np.copyto(dst, src), comm)
    red = timed(lambda: comm.Allreduce(src, dst, op=MPI.SUM), comm)
    return {"bytes": nbytes, "memcpy_s": bl.median(copy), "allreduce_s": bl.median(red),
            "memcpy_min_s": min(copy), "allreduce_min_s": min(red)}


def scaling(args) -> dict:
    import mpi4py

    mpi4py.rc.initialize = False  # tnt_comm initialised MPI (THREAD_MULTIPLE) on import
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = tnt.get_rank(), tnt.get_size()
    strategy, mwms_error = None, None
    if not args.no_mwms and n > 1:
        try:
            strategy = start_mwms(n)
        except Exception as err:
            mwms_error = short_error(err)
    name = "resnet"
    cfg = bl.MODELS[name]
    micro = cfg["micro_batch"]
    steps = max(4, cfg["steps"] // (2 if args.quick else 1))
    weights = bl.build(keras, name).get_weights()  # rank 0's are broadcast by each contender
    global_ds = bl.dataset(tf, name, micro * n, steps)   # tnt splits every global batch
    local_ds = bl.dataset(tf, name, micro, steps, seed=1 + rank)  # per-rank micro-batches
    sweep = (DEFAULT_KB,) if args.no_sweep else SWEEP_KB
    # The host's speed drifts over seconds, so the ratios that matter most are timed next
    # to each other in every round: Keras alone, tnt at the default threshold, the
    # independent ranks (weak-scaling efficiency and the lockstep ceiling's row).
    contenders: list[Contender] = [
        TntFit(f"tnt@{kb}", name, global_ds, micro * n * steps, weights, kb) for kb in sweep if kb != DEFAULT_KB
    ]
    contenders += [
        KerasFit("keras_alone", name, local_ds, micro * steps, weights, active=rank == 0),
        TntFit(f"tnt@{DEFAULT_KB}", name, global_ds, micro * n * steps, weights, DEFAULT_KB),
        KerasFit("keras_independent", name, local_ds, micro * steps, weights, step_times=True),
    ]
    if not args.no_nocomm:
        contenders.append(TntFit("tnt_nocomm", name, global_ds, micro * n * steps, weights, no_comm=True))
    contenders += [
        TntFit("tnt_syncbn", name, global_ds, micro * n * steps, weights, sync_bn=True),
        Mpi4pyNaive(name, local_ds, micro * n * steps, weights, comm),
    ]
    if strategy is not None:
        try:
            mwms = MwmsFit(strategy, name, global_ds, micro * n * steps)
            contenders.append(mwms)
            # MWMS's own ceiling: its Keras (tf_keras) on every rank, no communication.
            contenders.append(KerasFit(f"{mwms.keras.split()[0]}_independent", name, local_ds,
                                       micro * steps, None, kmod=mwms.kmod))
        except Exception as err:
            mwms_error = short_error(err)
    machine_before = bl.machine()
    runs = round_robin(contenders, args.rounds, args.epochs)
    grad_bytes = 4 * sum(int(np.prod(v.shape)) for v in contenders[0].model.trainable_variables)
    floor = gradient_floor(grad_bytes, comm)

    res: dict = {"mode": "scaling", "ranks": n, "model": name, "micro_batch": micro,
                 "steps_per_epoch": steps, "machine_before": machine_before,
                 "machine_after": bl.machine(), "floor": floor, "contenders": {},
                 "mwms": {"error": mwms_error} if mwms_error else None}
    mw = next((c for c in contenders if isinstance(c, MwmsFit)), None)
    if mw is not None:
        res["mwms"] = {"keras3": mw.keras3, "keras": mw.keras}
    for c in contenders:
        flat = [r for rnd in runs[c.name] for r in rnd]
        per_round = [bl.median(sps(rnd, c.samples_per_epoch)) if rnd else 0.0 for rnd in runs[c.name]]
        entry = {"samples_per_epoch": c.samples_per_epoch,
                 "sps_per_round": per_round,
                 "epoch_s": [r["seconds"] for r in flat]}
        if c.name.endswith("_independent"):  # total throughput: sum over the ranks
            totals = comm.allreduce(np.array(per_round), op=MPI.SUM)
            entry["sps_per_round"] = [float(x) for x in totals]
        if getattr(c, "step_times", False):  # issue 12: the lockstep ceiling of these ranks
            mine = [t for r in flat for t in r["step_seconds"]]
            everyone = comm.allgather(mine)
            entry["step_seconds_per_rank"] = everyone
            entry["lockstep_ceiling"] = bl.lockstep_ceiling(everyone)
            # Each round's own ceiling (its steps only), to divide the same round's ratios by.
            entry["lockstep_ceiling_per_round"] = [
                bl.lockstep_ceiling(comm.allgather([t for r in rnd for t in r["step_seconds"]]))
                for rnd in runs[c.name]]
        entry["sps"] = bl.median(entry["sps_per_round"])
        if flat and "wait_s" in flat[0]:
            entry["wait_fraction"] = bl.median([r["wait_s"] / r["seconds"] for r in flat])
            entry["submit_fraction"] = bl.median([r["submit_s"] / r["seconds"] for r in flat])
            entry["wait_per_step_s"] = bl.median([r["wait_s"] / max(1, r["waits"]) for r in flat])
            entry["step_s"] = bl.median([r["seconds"] / max(1, r["waits"]) for r in flat])
            entry["buckets"] = getattr(c, "buckets", 0)
        res["contenders"][c.name] = entry
    ref = res["contenders"][f"tnt@{DEFAULT_KB}"]["sps_per_round"]
    for entry in res["contenders"].values():  # paired: same round, same load
        entry["tnt_over_this_per_round"] = [a / b if b else None for a, b in zip(ref, entry["sps_per_round"])]
        entry["tnt_over_this"] = bl.median([x for x in entry["tnt_over_this_per_round"] if x is not None])
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("overhead", "scaling"))
    p.add_argument("--quick", action="store_true", help="fewer steps, rounds and epochs")
    p.add_argument("--rounds", type=int, default=None, help="round-robin repetitions")
    p.add_argument("--epochs", type=int, default=None, help="timed epochs per round")
    p.add_argument("--no-sweep", action="store_true", help="scaling: only the default threshold")
    p.add_argument("--no-mwms", action="store_true", help="scaling: without MultiWorkerMirroredStrategy")
    p.add_argument("--no-nocomm", action="store_true", help="scaling: without the tnt_nocomm contender")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    # scaling: many short rounds (8 x 1 epoch of 12 steps, ~2 s per contender) rather than
    # few long ones, so that paired contenders see the same stretch of the host's speed.
    args.rounds = args.rounds or (2 if args.quick else (6 if args.mode == "overhead" else 8))
    args.epochs = args.epochs or (1 if args.quick or args.mode == "scaling" else 2)
    t0 = time.perf_counter()
    result = overhead(args) if args.mode == "overhead" else scaling(args)
    result["wall_s"] = time.perf_counter() - t0
    result["rounds"], result["epochs_per_round"] = args.rounds, args.epochs
    if tnt.get_rank() != 0:
        return
    out = args.out or bl.RESULTS / (
        "training_overhead.json" if args.mode == "overhead" else f"training_scaling_{result['ranks']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"wrote {out} ({result['wall_s']:.0f} s)")


def print_table(r: dict) -> None:
    load = r["machine_before"]["loadavg"][0]
    if r["mode"] == "overhead":
        print(f"\n1-rank overhead (load {load:.2f}): samples/s, median of per-round ratios")
        print(f"{'model':>8} {'keras':>9} {'tnt':>9} {'tnt/keras':>9}")
        for name, m in r["models"].items():
            print(f"{name:>8} {m['keras_sps']:9.1f} {m['tnt_sps']:9.1f} {m['ratio']:9.3f}")
        return
    print(f"\nResNet-20 on {r['ranks']} ranks, micro-batch {r['micro_batch']} (load {load:.2f})")
    print(f"{'contender':>18} {'samples/s':>10} {'wait%':>6} {'submit%':>7} {'buckets':>7}")
    for name, c in r["contenders"].items():
        wf = f"{100 * c['wait_fraction']:6.1f}" if "wait_fraction" in c else f"{'':6}"
        sf = f"{100 * c['submit_fraction']:7.1f}" if "submit_fraction" in c else f"{'':7}"
        print(f"{name:>18} {c['sps']:10.1f} {wf} {sf} {c.get('buckets', ''):>7}")
    f = r["floor"]
    print(f"gradient exchange floor ({f['bytes']} B), median (min): memcpy {f['memcpy_s'] * 1e3:.3f} "
          f"({f['memcpy_min_s'] * 1e3:.3f}) ms, contiguous MPI_Allreduce {f['allreduce_s'] * 1e3:.3f} "
          f"({f['allreduce_min_s'] * 1e3:.3f}) ms")


if __name__ == "__main__":
    main()
