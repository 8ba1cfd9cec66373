"""Builds the C++ core with the repository's top-level CMakeLists.txt and runs ctest
(plan/buffer tables, 16-bit float conversions, TNT_* parser, engine in one process)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_ctest(tmp_path: Path) -> None:
    if not (ROOT / "CMakeLists.txt").exists():
        pytest.skip("the C++ tests build from the monorepo's top-level CMakeLists.txt")
    cmake = shutil.which("cmake", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert cmake, "cmake is a test dependency of tnt-comm (pip install cmake)"
    build = tmp_path / "build"
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    steps = [
        # Debug: assert() active and about 35 % less compile time than the default
        # RelWithDebInfo (51 vs 82 s on the 2-core CI machine); the Python tests run the
        # optimised module that pip built.
        [cmake, "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Debug", f"-DPython_EXECUTABLE={sys.executable}"],
        [cmake, "--build", str(build)],
        [str(Path(cmake).with_name("ctest")), "--test-dir", str(build), "--output-on-failure"],
    ]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "100% tests passed out of 3" in proc.stdout, proc.stdout
