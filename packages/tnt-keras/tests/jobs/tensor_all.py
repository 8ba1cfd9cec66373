"""ParallelStrategy.ALL with data replicas of tensor groups (N = 2 replicas x t = 2) against
serial Keras, in one launch.

Ranks 0-1 and 2-3 are the tensor groups; each reads its replica's slice of every global
batch (global batch 11, a last partial batch of 3: slices of unequal size). One case
(4 ranks on the CI machine's 2 cores: every case costs its tracing four times): the MLP
with an *edited* plan — the first Dense pair replicated, the lone head split as
column+allgather although the automatic plan keeps it whole, the second pair column/row —
trained with Adam. The case runner is the TENSOR job's (jobs/tensor_parallel.py); rank 0
writes the differences to serial Keras and every rank's checksums.
"""

from __future__ import annotations

import time
from pathlib import Path

import _job
import _replica_stats
import keras
import tensor_parallel as tp_job

import tarantella as tnt
import tnt_comm

T = 2
TP = tnt.tensor_parallel


def edited_plan(source: keras.Model) -> TP.Plan:
    return TP.plan(source, tensor_parallel_size=T).replicate("down1").split("head", "column+allgather")


def staged(seed: int) -> keras.Model:
    """The MLP with a SplitLayer after its first pair: stage 0 holds up1/down1, stage 1
    up2/act/down2, a (replicated) LayerNorm and the head; each pair is column/row split
    inside its stage."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((10,))
    h = keras.layers.Dense(16, activation="relu", name="up1")(x)
    h = keras.layers.Dense(12, name="down1")(h)
    h = tnt.keras.layers.SplitLayer(name="split")(h)
    h = keras.layers.Dense(24, name="up2")(h)
    h = keras.layers.Activation("tanh", name="act")(h)
    h = keras.layers.Dense(8, activation="relu", name="down2")(h)
    h = keras.layers.LayerNormalization(name="ln")(h)  # replicated
    y = keras.layers.Dense(4, activation="softmax", name="head")(h)
    return keras.Model(x, y, name="staged")


tp_job.BUILD["staged"] = staged


def automatic_plan(source: keras.Model) -> TP.Plan:
    return TP.plan(source, tensor_parallel_size=T, min_split_params=0)


# name: (model, optimizer, global batch, samples, epochs, plan, tol losses, tol weights, more tnt.Model options)
CASES = {
    "mlp_adam_edited": ("mlp", "adam", 11, 11 * 3 + 3, 2, edited_plan, 1e-5, 2e-5, {}),
    # 4 ranks: 1 replica x 2 stages x t=2 (ranks 0-1 stage 0, ranks 2-3 stage 1)
    "staged_adam_pipeline": ("staged", "adam", 11, 11 * 3 + 3, 2, automatic_plan, 1e-5, 2e-5,
                             {"num_micro_batches": 2}),
    # 8 ranks, opt-in (test_tensor_all.py): 2 replicas x 2 stages x t=2, one short epoch
    "staged_sgd_8ranks": ("staged", "sgd_momentum", 11, 11 + 3, 1, automatic_plan, 1e-5, 2e-5,
                          {"num_micro_batches": 2}),
}


def saving_checks(work: Path) -> dict:
    """mlp_adam_edited (2 replicas x t=2) ran with ModelCheckpoint and BackupAndRestore:
    its checkpoints are serial files of its weights, its backup after epoch 1 resumes as the
    whole run ended, and model.save writes a file plain Keras predicts with as serial does."""
    _, _, batch, n, epochs, make_plan, *_ = CASES["mlp_adam_edited"]
    out = tp_job.checkpoint_checks(T, work, strategy=tnt.ParallelStrategy.ALL, make_plan=make_plan,
                                   batch_n_epochs=(batch, n, epochs))
    out["plain_predict_diff"] = saved_predict_diff("mlp", "adam", work / "all.keras")
    loaded = tnt.models.load_model(work / "all.keras", parallel_strategy=tnt.ParallelStrategy.ALL,
                                   tensor_parallel_size=T, tensor_parallel_plan=make_plan(tp_job.mlp(0)))
    serial = tp_job.TRAINED["mlp", "adam"][0]
    xp, _ = tp_job.data("mlp", 9)
    out["load_all_replicas"] = loaded.num_replicas
    out["load_all_predict_diff"] = _job.max_abs_diff(loaded.predict(xp, verbose=0), serial.predict(xp, verbose=0))
    return out


def saved_predict_diff(kind: str, opt: str, path: Path) -> float:
    """model.save of the trained case, opened by plain Keras: its predictions against serial's."""
    serial, model, _, _ = tp_job.TRAINED[kind, opt]
    model.save(path)
    xp, _ = tp_job.data(kind, 9)
    return tp_job.on_master(lambda: _job.max_abs_diff(
        keras.saving.load_model(path).predict(xp, verbose=0), serial.predict(xp, verbose=0)))


def load_weights_error(kind: str, opt: str, path: Path) -> str:
    """What load_weights on pipeline stages of tensor groups says (refused, naming the fix)."""
    try:
        tp_job.TRAINED[kind, opt][1].load_weights(path)
    except TP.TensorParallelError as err:
        return str(err)
    return "no error"


def main() -> None:
    out = _job.out_path()
    cases = {}
    extra = {}
    for name in _job.only(CASES):
        started, cpu = time.perf_counter(), time.process_time()
        kind, opt, batch, n, epochs, make_plan, tol_l, tol_w, options = CASES[name]
        callbacks = tp_job.checkpoint_callbacks(out.parent) if name == "mlp_adam_edited" else None
        cases[name] = tp_job.run_case(kind, opt, batch, n, epochs, T, strategy=tnt.ParallelStrategy.ALL,
                                      make_plan=make_plan, callbacks=callbacks, **options)
        cases[name].update(tol_loss=tol_l, tol_weights=tol_w)
        if name == "mlp_adam_edited":
            extra["saving"] = saving_checks(out.parent)
        else:  # pipeline stages of tensor groups: the save gathers stages and joins shards
            cases[name]["plain_predict_diff"] = saved_predict_diff(kind, opt, out.parent / f"{name}.keras")
            cases[name]["load_weights_error"] = load_weights_error(kind, opt, out.parent / f"{name}.keras")
        # with its save / checkpoint checks: wall, and CPU summed over the ranks (/ cores: idle wall)
        cases[name]["seconds"] = (time.perf_counter() - started,
                                  sum(tnt_comm.allgather_object(time.process_time() - cpu)))
    # tensor groups of 2 x 2 replicas with BatchNormalization (replicated layers)
    extra["batch_norm_replicas"] = _replica_stats.one_model_after_fit(
        parallel_strategy=tnt.ParallelStrategy.ALL, tensor_parallel_size=T)
    _job.write(out, {"ranks": tnt.get_size(), "cases": cases, **extra})


if __name__ == "__main__":
    main()
