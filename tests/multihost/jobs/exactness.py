"""Serial equivalence across hosts: tnt-keras's exactness cases (a dense model and a CNN,
B % N != 0, a last batch smaller than B), run by this job on ranks spread over hosts.

Reuses packages/tnt-keras/tests/jobs/exactness.py (the case runner, models, data and
tolerances), so both suites hold tnt.Model to the same promise.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages" / "tnt-keras" / "tests" / "jobs"))

import _job  # determinism and threads are set on import
import exactness

import tarantella as tnt
import tnt_comm

#: (model kind, optimizer, global batch B, samples, epochs, weighted, shuffle seed,
#:  tolerance on losses/metrics, on weights) -- B % N != 0 for N = 3 and 4.
CASES = {
    "dense_adam_B11_last2": ("dense", "adam", 11, 11 * 2 + 2, 1, False, None, 1e-5, 2e-5),
    "cnn_momentum_B10_last3": ("cnn", "sgd_momentum", 10, 10 * 2 + 3, 1, False, None, 1e-4, 1e-3),
}


def main() -> None:
    out = _job.out_path()
    hosts = tnt_comm.allgather_object(socket.gethostname())
    results = {}
    for name, (kind, opt, batch, n, epochs, weighted, seed, tol_l, tol_w) in CASES.items():
        results[name] = exactness.run_case(kind, opt, batch, n, epochs, weighted, seed, "auto")
        results[name].update(tol_loss=tol_l, tol_weights=tol_w, batch=batch)
    _job.write(out, {"ranks": tnt.get_size(), "hosts": hosts, "cases": results})


if __name__ == "__main__":
    main()
