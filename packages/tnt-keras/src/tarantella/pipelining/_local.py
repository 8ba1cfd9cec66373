"""All stages of one pipeline in this process, one thread per stage.

For trying a plan and for tests: the stages run the same executor and end-of-step code
as on p ranks, with messages passed through in-process queues (headers checked alike),
so results equal a launched run's. Not a way to train faster.
"""

from __future__ import annotations

import threading

from ._interleaved import check_interleaved_options, chunk_plan
from ._plan import Plan
from ._remat import check_remat
from ._schedule import check_schedule
from ._stage_runtime import StageRuntime
from ._stages import serial_weights
from ._transport import LocalTransport


def _in_threads(fns):
    results = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)

    def run(k):
        try:
            results[k] = fns[k]()
        except BaseException as err:
            errors[k] = err

    threads = [threading.Thread(target=run, args=(k,), name=f"tnt-stage-{k}") for k in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for err in errors:
        if err is not None:
            raise err
    return results


class LocalPipeline:
    """A pipelined ``model`` whose p stages are threads of this process."""

    def __init__(self, model, num_pipeline_stages: int | None = None, *, num_micro_batches: int = 4,
                 pipeline_schedule: str = "1f1b", pipeline_plan: Plan | None = None,
                 remat: str | None = None, virtual_stages: int | None = None, timeout: float = 120.0) -> None:
        check_schedule(pipeline_schedule)
        self.plan, p, v = chunk_plan(model, pipeline_schedule, num_pipeline_stages, virtual_stages, pipeline_plan)
        check_interleaved_options(pipeline_schedule, "pipelining", p, num_micro_batches)
        transports = LocalTransport.group(p, timeout)
        self.stages = [StageRuntime(self.plan, t, pipeline_schedule, num_micro_batches, remat=check_remat(remat),
                                    virtual_stages=v)
                       for t in transports]

    def compile(self, optimizer, loss=None, metrics=None, **kwargs) -> None:
        """Compile every stage with the same optimizer, loss and metrics."""
        for st in self.stages:
            st.compile(optimizer, loss=loss, metrics=metrics, **kwargs)

    def train_step(self, x, y, sample_weight=None) -> dict:
        """One pipelined training step of all stages (threads); the last stage's logs."""
        return _in_threads([lambda st=st: st.train_step(x, y, sample_weight) for st in self.stages])[0]

    def test_step(self, x, y, sample_weight=None) -> dict:
        """One forward-only step with loss and metrics; the last stage's logs."""
        return _in_threads([lambda st=st: st.test_step(x, y, sample_weight) for st in self.stages])[0]

    def predict_step(self, x):
        """The model's outputs for ``x``, run through all stages."""
        return _in_threads([lambda st=st: st.predict_step(x) for st in self.stages])[0]

    def reset_metrics(self) -> None:
        """Reset the metric states of every stage."""
        for st in self.stages:
            st.reset_metrics()

    def get_weights(self) -> list:
        """All stages' weights in the serial model's ``get_weights()`` order."""
        return serial_weights(self.plan, [st.model for st in self.stages])
