"""Peer: TensorFlow's MultiWorkerMirroredStrategy on the model, data and threads of training.py.

    python benchmarks/peer_mwms.py [--ranks 2] [--quick]

Without ``TF_CONFIG`` this is the driver: it picks free localhost ports, starts ``--ranks``
worker copies of itself with ``TF_CONFIG`` set, and writes results/mwms.json from the
workers' output. Each worker first tries Keras 3 (``import keras``) under the strategy;
Keras 3 is known to fail here (PerReplica values reach ``fit``), so the error is recorded
and the worker then trains with the legacy ``tf_keras`` package (``TF_USE_LEGACY_KERAS=1``),
ResNet-20, global batch = micro-batch x workers, timed like training.py (warm-up epoch,
then rounds x epochs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl

MODEL = "resnet"


def free_ports(k: int) -> list[int]:
    socks = []
    for _ in range(k):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def first_line(err: BaseException) -> str:
    """The error's type, first and last lines (the middle may be a whole tensor dump)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(err).__name__}: {text}"[:300]


def worker(args) -> None:
    import tensorflow as tf

    bl.pin_threads(tf)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    cfg = bl.MODELS[MODEL]
    micro = cfg["micro_batch"]
    steps = max(4, cfg["steps"] // (2 if args.quick else 1))
    ds = bl.dataset(tf, MODEL, micro * n, steps)
    record: dict = {"task": task, "workers": n, "micro_batch": micro, "steps_per_epoch": steps}

    import keras  # Keras 3

    try:
        with strategy.scope():
            model = bl.build(keras, MODEL)
            bl.compile_model(model)
        model.fit(ds.take(1), epochs=1, verbose=0)
        record["keras3"], kmod = "ok", keras
    except Exception as err:  # recorded, then the legacy path runs
        record["keras3"] = first_line(err)
        import tf_keras as kmod

        with strategy.scope():
            model = bl.build(kmod, MODEL)
            bl.compile_model(model)
    timer = bl.EpochTimer.make(kmod)
    model.fit(ds, epochs=1, verbose=0)  # warm-up
    per_round = []
    for _ in range(args.rounds):
        timer.seconds.clear()
        model.fit(ds, epochs=args.epochs, verbose=0, callbacks=[timer])
        per_round.append(bl.median([micro * n * steps / s for s in timer.seconds]))
    name = "keras" if kmod is keras else "tf_keras"
    record.update(keras=f"{name} {kmod.__version__}", sps_per_round=per_round,
                  sps=bl.median(per_round), machine=bl.machine())
    bl.emit(record)


def driver(args) -> int:
    ports = free_ports(args.ranks)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = []
    t0 = time.perf_counter()
    machine_before = bl.machine()
    for i in range(args.ranks):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
                   TF_USE_LEGACY_KERAS="1")
        cmd = [sys.executable, __file__, *sys.argv[1:]]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=args.timeout)
            outs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        outs = [(-9, "", f"timed out after {args.timeout} s")] * len(procs)
    records = [r for _, out, _ in outs for r in bl.parse_results(out)]
    result: dict = {"ranks": args.ranks, "model": MODEL, "machine_before": machine_before,
                    "machine_after": bl.machine(), "wall_s": time.perf_counter() - t0}
    if len(records) == args.ranks:
        chief = min(records, key=lambda r: r["task"])
        result.update(ok=True, **{k: chief[k] for k in ("keras3", "keras", "sps", "sps_per_round",
                                                         "micro_batch", "steps_per_epoch")})
    else:
        tails = [err.strip().splitlines()[-1] if err.strip() else f"exit {rc}" for rc, _, err in outs]
        result.update(ok=False, error="; ".join(sorted(set(tails)))[:500], sps=0.0)
    out = args.out or bl.RESULTS / f"mwms_{args.ranks}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nMultiWorkerMirroredStrategy, {args.ranks} workers, ResNet-20 "
          f"(load {machine_before['loadavg'][0]:.2f})")
    if result["ok"]:
        print(f"  Keras 3: {result['keras3']}")
        print(f"  {result['keras']}: {result['sps']:.1f} samples/s")
    else:
        print(f"  could not run: {result['error']}")
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the workers are killed")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.epochs = args.epochs or (1 if args.quick else 2)
    if "TF_CONFIG" in os.environ:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
