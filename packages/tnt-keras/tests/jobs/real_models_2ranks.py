"""The real-model jobs of 2 ranks in one launch: keras-hub Transformers under DATA
(jobs/real_models.py), PIPELINING (jobs/real_models_pipeline.py) and TENSOR
(jobs/real_models_tensor.py), one after another in the same processes.

TensorFlow and keras-hub are imported once per rank instead of once per strategy (about
20 s of CPU per process on the CI machine). Before each part the Keras session is cleared,
so auto-generated layer names and seeds start as in a fresh process: each part sees what
its own launch would see. Each job still runs on its own (`python jobs/real_models.py`).
"""

from __future__ import annotations

import sys
import time

import _job
import keras
import real_models
import real_models_pipeline
import real_models_tensor

import tarantella as tnt

#: The GPT-2 backbone with a pooled head trains inside GPT2CausalLM (the backbone, plus its
#: tied embedding) under DATA and PIPELINING, and alone under TENSOR (with its files): the
#: suite's launch leaves its DATA and PIPELINING runs to the jobs run on their own
#: (``python jobs/real_models.py``), ~2 x 40 s of CI's 2-rank launch.
LEFT_OUT = {"data": ("gpt2",), "pipelining": ("gpt2",)}
PARTS = {
    "data": (real_models.run_all, [n for n in real_models.MODELS if n not in LEFT_OUT["data"]]),
    "pipelining": (real_models_pipeline.run_all,
                   [n for n in real_models_pipeline.MODELS if n not in LEFT_OUT["pipelining"]]),
    "tensor": (real_models_tensor.run_all, list(real_models_tensor.CASES)),
}


def main() -> None:
    out = _job.out_path()
    results, seconds = {}, {}
    for part in _job.only(PARTS):
        run_all, names = PARTS[part]
        keras.backend.clear_session()
        t0 = time.perf_counter()
        results[part] = run_all(names)
        seconds[part] = round(time.perf_counter() - t0, 1)
        if tnt.is_master_rank():  # where the launch's time goes, in the test log
            print(f"real_models_2ranks: {part} took {seconds[part]:.0f} s", file=sys.stderr, flush=True)
    _job.write(out, {"ranks": tnt.get_size(), "parts": results, "seconds": seconds})


if __name__ == "__main__":
    main()
