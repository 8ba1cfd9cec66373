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


# name: (model, optimizer, global batch, samples, epochs, plan, tol losses, tol weights)
CASES = {"mlp_adam_edited": ("mlp", "adam", 11, 11 * 3 + 3, 2, edited_plan, 1e-5, 2e-5)}


def main() -> None:
    out = _job.out_path()
    cases = {}
    for name, (kind, opt, batch, n, epochs, make_plan, tol_l, tol_w) in CASES.items():
        cases[name] = tp_job.run_case(kind, opt, batch, n, epochs, T, strategy=tnt.ParallelStrategy.ALL,
                                      make_plan=make_plan)
        cases[name].update(tol_loss=tol_l, tol_weights=tol_w)
    _job.write(out, {"ranks": tnt.get_size(), "cases": cases})


if __name__ == "__main__":
    main()
