"""ZB-H1 against 1F1B (bitwise) and serial Keras, and the timeline, on 2 ranks.

One small model (L2 on stage 0, stage 0's output also read after the cut: two
boundaries) trained serially and pipelined (1F1B, then ZB-H1 inside ``tnt.timeline``)
from the same initial weights on the same batches (the last one smaller than the others).
Then a short data-parallel fit inside a second timeline (fusion buckets). The launch sets
``TNT_TIMELINE`` too: that file, written at exit, holds the whole job. Rank 0 writes the
JSON, with each timeline's summary and the counts the test checks.
"""

from __future__ import annotations

import _job
import keras
import numpy as np

import tarantella as tnt
import tnt_comm
from tarantella.timeline import load, summarize

SplitLayer = tnt.keras.layers.SplitLayer
M, BATCH, EPOCHS = 4, 8, 1


def model() -> keras.Model:
    keras.utils.set_random_seed(11)
    a = keras.Input((6,), name="a")
    x0 = keras.layers.Dense(12, activation="tanh", name="d0", kernel_regularizer=keras.regularizers.L2(0.01))(a)
    x = SplitLayer(name="cut")(x0)
    x = keras.layers.Dense(12, activation="tanh", name="d1")(x)
    x = keras.layers.Concatenate(name="cat")([x, x0])
    return keras.Model(a, keras.layers.Dense(3, activation="softmax", name="out")(x), name="zb")


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(20, 6)).astype("float32"), rng.integers(0, 3, 20).astype("int32")


def compiled(m):
    m.compile(keras.optimizers.Adam(0.02), "sparse_categorical_crossentropy")
    return m


def train_serial():
    x, y = data()
    m = compiled(model())
    hist = m.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    return hist, m.get_weights()


def train_pipelined(schedule: str):
    x, y = data()
    m = compiled(tnt.Model(model(), parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_pipeline_stages=2,
                           num_micro_batches=M, pipeline_schedule=schedule))
    hist = m.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    return hist, m.get_weights(), m


def counts(trace: dict) -> dict:
    """Per rank: events by category, the peers of its sends and receives, its stages."""
    out: dict = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        r = out.setdefault(str(e["pid"]), {"cats": {}, "peers": [], "names": []})
        r["cats"][e["cat"]] = r["cats"].get(e["cat"], 0) + 1
        if "peer" in e["args"]:
            r["peers"] = sorted(set(r["peers"]) | {e["args"]["peer"]})
        if e["cat"] in ("forward", "backward", "weight"):
            r["names"].append(e["name"])
    return out


def causality_gap(trace: dict) -> float:
    """The smallest (stage 1's start of F(i) - stage 0's end of F(i)) over the steps and
    micro-batches, on the merged clock: >= 0 when the offsets are right (F(i) on stage 1
    needs stage 0's output)."""
    ends, starts = {}, {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["cat"] == "forward":
            key = (e["args"]["step"], e["args"]["mb"])
            if e["args"]["stage"] == 0:
                ends[key] = e["ts"] + e["dur"]
            else:
                starts[key] = e["ts"]
    return min(starts[k] - ends[k] for k in starts) * 1e-6


def main() -> int:
    out = _job.out_path()
    serial_hist, serial_w = train_serial()
    h1, w1, _ = train_pipelined("1f1b")
    path = str(out.with_name("zb_h1_timeline.json"))
    with tnt.timeline(path):
        hz, wz, mz = train_pipelined("zb-h1")
    result = {"ranks": tnt.get_size(), "cases": {}}
    for name, (h, w) in {"1f1b": (h1, w1), "zb-h1": (hz, wz)}.items():
        result["cases"][name] = {"history_diff": _job.history_diff(h, serial_hist),
                                 "weight_diff": _job.max_abs_diff(w, serial_w)}
    result["zb_h1_bitwise_1f1b"] = len(w1) == len(wz) and all(np.array_equal(a, b) for a, b in zip(w1, wz))
    result["zb_h1_history_equals_1f1b"] = hz == h1
    result["peak_live"] = tnt_comm.allgather_object(mz.pipeline_stats()["peak_micro_batches_in_flight"])

    # data parallelism: fusion buckets from submit to done, the wait
    x, y = data()
    dp_path = str(out.with_name("dp_timeline.json"))
    with tnt.timeline(dp_path):
        dp = compiled(tnt.Model(model()))
        dp_hist = dp.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    result["dp"] = {"history_diff": _job.history_diff(dp_hist, serial_hist),
                    "weight_diff": _job.max_abs_diff(dp.get_weights(), serial_w)}
    if tnt.is_master_rank():
        zb = load(path)
        result["zb_timeline"] = {"counts": counts(zb), "summary": summarize(zb), "causality_gap_s": causality_gap(zb),
                                 "clock": zb["otherData"]["tarantella"]}
        dpt = load(dp_path)
        result["dp_timeline"] = {"counts": counts(dpt), "summary": summarize(dpt)}
    _job.write(out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
