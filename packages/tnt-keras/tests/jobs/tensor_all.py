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

import _job
import keras
import tensor_parallel as tp_job

import tarantella as tnt

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
}


def main() -> None:
    out = _job.out_path()
    cases = {}
    for name in _job.only(CASES):
        kind, opt, batch, n, epochs, make_plan, tol_l, tol_w, options = CASES[name]
        cases[name] = tp_job.run_case(kind, opt, batch, n, epochs, T, strategy=tnt.ParallelStrategy.ALL,
                                      make_plan=make_plan, **options)
        cases[name].update(tol_loss=tol_l, tol_weights=tol_w)
    _job.write(out, {"ranks": tnt.get_size(), "cases": cases})


if __name__ == "__main__":
    main()
