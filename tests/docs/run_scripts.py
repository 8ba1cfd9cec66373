"""Launched job: run several complete docs scripts one after another in the same processes.

    tarantella -n 2 -- run_scripts.py ID=DIR/script.py ID=DIR/script.py ...

Each script runs as `python script.py` would run it (fresh globals, `__name__ ==
"__main__"`, its own directory as working directory), but the ranks import TensorFlow
once for all of them instead of once per script: on the 2-core CI machine that import
costs ~17 s of CPU per process and dominates a small script's run. After each script
every rank meets in a barrier, so a script that fails on any rank ends the job (the
launcher stops all ranks) before the master reports it done; the master prints
`STARTED id` and `DONE id` lines, which tests/docs/test_code_blocks.py checks per script.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import tnt_comm

STARTED, DONE = "docs-script-started:", "docs-script-done:"


def run(block_id: str, script: Path) -> None:
    master = tnt_comm.rank() == 0
    if master:
        print(STARTED, block_id, flush=True)
    os.chdir(script.parent)
    sys.argv = [str(script)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    tnt_comm.barrier()  # every rank finished this script
    if master:
        print(DONE, block_id, flush=True)


def main(specs: list[str]) -> None:
    for spec in specs:
        block_id, _, script = spec.rpartition("=")
        run(block_id, Path(script))


if __name__ == "__main__":
    main(sys.argv[1:])
