"""Resume job, run twice with the same command on 2 ranks.

First run: trains EPOCHS epochs with BackupAndRestore and ModelCheckpoint; while the
checkpoint of epoch KILL_EPOCH is being written, rank 0 is SIGKILLed (its temporary file
half written), after BackupAndRestore saved that epoch. Second run (the same command):
  1. manual resume: tnt.models.load_model(model.keras) holds the last complete checkpoint
     (epoch KILL_EPOCH - 1); fit(initial_epoch=KILL_EPOCH) continues from it;
  2. BackupAndRestore resumes at epoch KILL_EPOCH + 1;
  3. an uninterrupted reference run from the same seed.
Rank 0 writes the checks as JSON; the test asserts them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from pathlib import Path

import _job
import keras
import numpy as np

import tarantella as tnt
import tnt_comm

EPOCHS, KILL_EPOCH, BATCH = 4, 1, 10
CHECKS: dict[str, dict] = {}


def check(name: str, ok: bool, detail: object = "") -> None:
    CHECKS[name] = {"ok": bool(ok), "detail": str(detail)[:2000]}


def digest(model) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())).hexdigest()


def data():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 3, size=75).astype("int32")
    x = (rng.normal(size=(75, 6)) + y[:, None] * 0.5).astype("float32")
    return x, y


def build() -> tnt.Model:
    keras.utils.set_random_seed(7)  # makes the common shuffle seed the same in every run
    model = tnt.Model(keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                        keras.layers.Dense(3, activation="softmax")]))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class Recorder(keras.callbacks.Callback):
    """Rank 0 keeps each epoch's logs and weight digest in <folder>/<name>.json."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.epochs: dict[int, dict] = {}

    def on_epoch_end(self, epoch, logs=None):
        self.epochs[epoch] = {"logs": {k: float(v) for k, v in logs.items()}, "digest": digest(self.model)}
        if tnt.is_master_rank():
            self.path.write_text(json.dumps(self.epochs))


def die_while_saving(folder: Path) -> None:
    """First run: rank 0 dies with the checkpoint of epoch KILL_EPOCH half written."""
    real_save = keras.Model.save
    saves = []

    def save(self, filepath, *args, **kwargs):
        real_save(self, filepath, *args, **kwargs)
        saves.append(filepath)
        if tnt.is_master_rank() and len(saves) == KILL_EPOCH + 1:
            size = os.path.getsize(filepath)
            with open(filepath, "r+b") as f:
                f.truncate(size // 2)
            (folder / "interrupted").write_text(str(filepath))
            os.kill(os.getpid(), signal.SIGKILL)

    keras.Model.save = save


def callbacks(folder: Path, name: str) -> list:
    return [Recorder(folder / f"{name}.json"), keras.callbacks.BackupAndRestore(str(folder / "backup")),
            keras.callbacks.ModelCheckpoint(str(folder / "model.keras"))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    folder = parser.parse_args().out.parent
    x, y = data()
    fit_args = dict(batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0)
    if not (folder / "interrupted").exists():
        die_while_saving(folder)
        build().fit(x, y, callbacks=callbacks(folder, "first"), **fit_args)
        raise AssertionError("the first run was not interrupted")

    first = {int(k): v for k, v in json.loads((folder / "first.json").read_text()).items()}
    # 1. The manual way, from the last complete checkpoint (written at epoch KILL_EPOCH - 1).
    keras.utils.set_random_seed(7)
    manual = tnt.models.load_model(folder / "model.keras")
    check("checkpoint_intact", digest(manual) == first[KILL_EPOCH - 1]["digest"],
          dict(loaded=digest(manual), expected=first[KILL_EPOCH - 1]["digest"]))
    h_manual = manual.fit(x, y, initial_epoch=KILL_EPOCH, **fit_args)

    # 2. BackupAndRestore: the same call as in the first run.
    resumed = build()
    h_resumed = resumed.fit(x, y, callbacks=callbacks(folder, "resumed"), **fit_args)
    backup_left = (folder / "backup").exists()

    # 3. The uninterrupted reference.
    reference = build()
    h_ref = reference.fit(x, y, **fit_args)
    ref = h_ref.history

    def part(history: dict, epochs) -> dict:
        return {k: [history[k][e] for e in epochs] for k in sorted(history)}

    first_logs = {k: [first[e]["logs"][k] for e in range(KILL_EPOCH + 1)] for k in sorted(ref)}
    check("first_run_history_equal", _job.history_diff(first_logs, part(ref, range(KILL_EPOCH + 1))) <= 1e-6,
          dict(first=first_logs, reference=ref))
    check("backup_resumed_at_next_epoch", h_resumed.epoch == list(range(KILL_EPOCH + 1, EPOCHS)), h_resumed.epoch)
    d_hist = _job.history_diff(h_resumed.history, part(ref, range(KILL_EPOCH + 1, EPOCHS)))
    d_w = _job.max_abs_diff(resumed.get_weights(), reference.get_weights())
    check("backup_resume_equals_uninterrupted", d_hist <= 1e-6 and d_w <= 1e-6,
          dict(history=d_hist, weights=d_w, resumed=h_resumed.history, reference=ref))
    check("backup_dir_deleted_at_end", not backup_left, backup_left)
    d_hist = _job.history_diff(h_manual.history, part(ref, range(KILL_EPOCH, EPOCHS)))
    d_w = _job.max_abs_diff(manual.get_weights(), reference.get_weights())
    check("manual_resume_equals_uninterrupted", h_manual.epoch == list(range(KILL_EPOCH, EPOCHS))
          and d_hist <= 1e-6 and d_w <= 1e-6, dict(history=d_hist, weights=d_w, epochs=h_manual.epoch))
    digests = tnt_comm.allgather_object([digest(resumed), digest(manual)])
    check("replicas_identical", all(d == digests[0] for d in digests), digests)
    tnt_comm.barrier()
    _job.write(parser.parse_args().out, {"ranks": tnt.get_size(), "checks": CHECKS})


if __name__ == "__main__":
    main()
