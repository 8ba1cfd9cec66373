"""Run several job scripts in one launch: each rank imports TensorFlow once for all of them.

``--spec`` names a JSON list of {"job": <script in jobs/>, "argv": [...]}; each script runs
as ``__main__`` with its own argv (its ``--out``) in a fresh module namespace, in order,
with a fresh Keras session (layer names, the global seed) between them. Rank 0 writes
``--out`` with the rank count once every part has finished.
"""

from __future__ import annotations

import argparse
import gc
import json
import runpy
import sys
from pathlib import Path

import _job
import keras

import tarantella as tnt
import tnt_comm

JOBS = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--spec", required=True, type=Path)
    args = parser.parse_args()
    for part in json.loads(args.spec.read_text()):
        sys.argv = [str(JOBS / part["job"]), *part["argv"]]
        runpy.run_path(sys.argv[0], run_name="__main__")
        tnt_comm.barrier()
        keras.backend.clear_session()
        keras.mixed_precision.set_global_policy("float32")
        gc.collect()
    _job.write(args.out, {"ranks": tnt.get_size()})


if __name__ == "__main__":
    main()
