"""Without memory limits, for real (issue 31): a model whose serial training dies under a
per-process cap trains with ``ParallelStrategy.AUTO`` on 2 ranks under the same cap, as
serial Keras trains it without the cap.

    python benchmarks/auto_prlimit.py [--cap-mib 1300] [--width 6144]

1. serial Keras without a cap: the reference History and weights;
2. serial Keras under ``prlimit --data=<cap>`` (every rank's, and the serial process',
   private data: allocations beyond it fail): expected to die;
3. ``tarantella -n 2`` under the same ``prlimit``: the model built under
   ``tnt.deferred_variables()``, ``tnt.Model(..., parallel_strategy=AUTO)`` with the
   default budget (the cap less what the process already holds), trained and compared.
Prints one JSON line with the outcome and the differences to the reference (History and
the trained model's predictions: ``get_weights()`` would gather the whole model on a rank,
which is what the cap forbids).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PY = sys.executable
HERE = Path(__file__).resolve()
BATCH, EPOCHS, SAMPLES, IN = 16, 1, 64, 256


def build(width: int):
    import keras

    keras.utils.set_random_seed(5)
    inp = keras.Input((IN,))
    x = keras.layers.Dense(width, activation="tanh", name="d1")(inp)
    x = keras.layers.Dense(width, activation="tanh", name="d2")(x)
    x = keras.layers.Dense(width, activation="tanh", name="d3")(x)
    return keras.Model(inp, keras.layers.Dense(4, name="head")(x))


def train(model):
    import keras
    import numpy as np

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(SAMPLES, IN)).astype("float32"), rng.integers(0, 4, size=SAMPLES)
    model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    h = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    # predictions, not get_weights(): gathering the whole model on a rank would break the cap
    return h.history, model.predict(x, batch_size=BATCH, verbose=0)


def run_serial(width: int, out: str) -> None:
    import numpy as np

    hist, pred = train(build(width))
    np.savez(out, loss=np.array(hist["loss"]), pred=np.asarray(pred))


def run_auto(width: int, out: str) -> None:
    import numpy as np

    import tarantella as tnt

    with tnt.deferred_variables():
        keras_model = build(width)
    model = tnt.Model(keras_model, parallel_strategy=tnt.ParallelStrategy.AUTO, global_batch_size=BATCH)
    if tnt.is_master_rank():
        model._tnt_plan.summary()
    hist, pred = train(model)
    if tnt.is_master_rank():
        np.savez(out, loss=np.array(hist["loss"]), pred=np.asarray(pred))


def compare(a: str, b: str) -> dict:
    import numpy as np

    x, y = np.load(a), np.load(b)
    return {"loss_diff": float(np.max(np.abs(x["loss"] - y["loss"]))),
            "predict_diff": float(np.max(np.abs(x["pred"] - y["pred"])))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="drive", choices=("drive", "serial", "auto"))
    ap.add_argument("--out", default="")
    ap.add_argument("--cap-mib", type=int, default=1300)
    ap.add_argument("--width", type=int, default=6144)
    args = ap.parse_args()
    if args.mode == "serial":
        run_serial(args.width, args.out)
        return 0
    if args.mode == "auto":
        run_auto(args.width, args.out)
        return 0
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_DETERMINISTIC_OPS": "1", "OMP_NUM_THREADS": "1"}
    cap = ["prlimit", f"--data={args.cap_mib * 2**20}"]
    launcher = str(Path(PY).parent / "tarantella")
    res: dict = {"cap_mib": args.cap_mib, "width": args.width, "weight_bytes": 4 * (IN * args.width + 2 * args.width**2)
                 + 4 * (3 * args.width + 4 * args.width + 4)}
    with tempfile.TemporaryDirectory() as tmp:
        ref, capped, auto = (str(Path(tmp) / n) for n in ("ref.npz", "capped.npz", "auto.npz"))
        serial = [PY, str(HERE), "serial", "--width", str(args.width)]
        p = subprocess.run([*serial, "--out", ref], env=env, capture_output=True, text=True)
        res["serial_uncapped_rc"] = p.returncode
        p = subprocess.run([*cap, *serial, "--out", capped], env=env, capture_output=True, text=True)
        res["serial_capped_rc"] = p.returncode
        res["serial_capped_error"] = (p.stderr.strip().splitlines() or [""])[-1][:200]
        p = subprocess.run([*cap, launcher, "-n", "2", "--python-interpreter", PY, "--", str(HERE), "auto",
                            "--width", str(args.width), "--out", auto], env=env, capture_output=True, text=True)
        res["auto_capped_rc"] = p.returncode
        res["auto_summary"] = [ln for ln in p.stdout.splitlines() if ln.startswith(("chosen", "tnt.plan"))]
        if p.returncode != 0:
            res["auto_error"] = p.stderr[-1500:]
        if res["serial_uncapped_rc"] == 0 and p.returncode == 0:
            res.update(compare(ref, auto))
    print(json.dumps(res))
    return 0 if res.get("auto_capped_rc") == 0 and res.get("serial_capped_rc") != 0 else 1


if __name__ == "__main__":
    sys.exit(main())
