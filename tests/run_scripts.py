"""Launched job: run several user scripts one after another in the same processes.

    tarantella -n 2 -- run_scripts.py "ID=WORKDIR SCRIPT [ARG ...]" "ID=WORKDIR SCRIPT" ...

Each script runs as `python script.py ARG ...` would run it (fresh globals, `__name__ ==
"__main__"`, `sys.argv`, WORKDIR as working directory, a cleared Keras session),
but the ranks import TensorFlow once for all of them instead of once per script: on the
2-core CI machine that import costs ~17 s of CPU per process and dominates a small
script's run. After each script every rank meets in a barrier, so a script that fails on
any rank ends the job (the launcher stops all ranks) before the master reports it done;
the master prints `docs-script-started: ID` and `docs-script-done: ID` lines, which
tests/docs and tests/examples check per script (`script_output` cuts one script's part).
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import sys
import time
from pathlib import Path

STARTED, DONE = "docs-script-started:", "docs-script-done:"
TOOK = "run_scripts: took"  # the master's stderr: where a shared launch's time goes
RUNNER = Path(__file__)


def script_output(stdout: str, script_id: str) -> str | None:
    """The master's output of one script of the job, or None if it did not finish."""
    found = re.search(rf"^{STARTED} {re.escape(script_id)}\n(.*?)^{DONE} {re.escape(script_id)}$",
                      stdout, flags=re.M | re.S)
    return found.group(1) if found else None


def run(script_id: str, workdir: Path, script: Path, args: list[str]) -> None:
    import tnt_comm  # here: the tests import script_output without starting MPI

    master = tnt_comm.rank() == 0
    if master:
        print(STARTED, script_id, flush=True)
    t0 = time.perf_counter()
    if "keras" in sys.modules:  # layer names and seeds as in a fresh process
        sys.modules["keras"].backend.clear_session()
    os.chdir(workdir)
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    tnt_comm.barrier()  # every rank finished this script
    if master:
        print(DONE, script_id, flush=True)
        print(f"{TOOK} {script_id} {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def main(specs: list[str]) -> None:
    for spec in specs:
        script_id, _, command = spec.partition("=")
        workdir, script, *args = shlex.split(command)
        run(script_id, Path(workdir), Path(script), args)


if __name__ == "__main__":
    main(sys.argv[1:])
