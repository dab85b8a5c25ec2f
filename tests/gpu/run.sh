#!/usr/bin/env bash
# tests/gpu/run.sh -- kvcore's GPU checks on a bare CUDA machine, one step at a time.
#
#   tests/gpu/run.sh [STEP ...]      steps: driver install ipc conformance gpu bench
#                                    (default: all, in that order)
#
# Run from anywhere; it works in the repository root. Each step runs under its own
# timeout (seconds, overridable: KVCORE_GPU_TIMEOUT_<STEP>=...) and writes under
# $OUT (default ./gpu-out), at most 8 files:
#
#   summary.txt       one line per step: name, exit status, seconds
#   driver.log        nvidia-smi, the driver's CUDA version, torch/triton/cupy versions
#   install.log       what was installed from the carried wheels
#   ipc.log           the CUDA IPC cross-process tests (tests/test_client_gpu.py)
#   conformance.log   `kvcore conformance` of torch, triton and cupy on cuda
#   gpu.log           the other GPU tests (pytest -m gpu)
#   bench.json/.log   `kvcore bench kernels --device cuda --json`
#
# Nothing is downloaded here (the machine may have no network): missing Python
# packages come from the wheels folder $KVCORE_WHEELS (default tests/gpu/wheels),
# filled beforehand on a networked machine; docs/benchmarks.md gives the command.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
WHEELS=${KVCORE_WHEELS:-tests/gpu/wheels}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt

# step NAME LOG DEFAULT_TIMEOUT COMMAND...: run COMMAND with its output appended to LOG
step() {
  local name=$1 log=$OUT/$2 limit=$3 var start rc
  shift 3
  var=KVCORE_GPU_TIMEOUT_${name^^}
  limit=${!var:-$limit}
  start=$(date +%s)
  echo "== $name: $* (timeout ${limit}s)" >>"$log"
  timeout --kill-after=15 "$limit" bash -c '"$@"' "$name" "$@" >>"$log" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - start))s" | tee -a "$SUMMARY"
  return $rc
}

driver() {
  nvidia-smi || return 1
  # Triton 3.9 assembles sm_90 with its bundled ptxas 13.4 (PTX ISA 9.4), which only a
  # CUDA 13 driver loads. On an older driver, point Triton at the CUDA 12.9 ptxas the
  # wheel also ships (it then emits PTX 8.8); later steps read the choice from here.
  local cuda major
  cuda=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)
  major=${cuda%%.*}
  echo "driver CUDA version: ${cuda:-unknown}"
  if [[ -n $major && $major -lt 13 ]]; then
    echo "WARNING: driver CUDA $cuda < 13: Triton's PTX 9.4 will not load"
    echo "LEGACY_PTXAS: later steps use the bundled CUDA 12.9 ptxas"
  fi
  "$PY" - <<'EOF'
import importlib
for name in ("torch", "triton", "cupy"):
    try:
        module = importlib.import_module(name)
        print(name, module.__version__)
    except Exception as exc:  # reported, not fatal: the steps that need it fail
        print(name, "missing:", exc)
import torch
print("cuda available:", torch.cuda.is_available(), torch.version.cuda)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
EOF
}

install() {
  # module -> package, for what kvcore and its tests import
  local pairs="zmq:pyzmq msgspec:msgspec prometheus_client:prometheus-client rich:rich
    msgpack:msgpack hypothesis:hypothesis pytest:pytest pytest_timeout:pytest-timeout"
  local need=() pair
  for pair in $pairs; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || need+=("${pair##*:}")
  done
  if ((${#need[@]})); then
    echo "installing from $WHEELS: ${need[*]}"
    "$PY" -m pip install --no-index --find-links "$WHEELS" "${need[@]}" || return 1
  fi
  if ! "$PY" -c "import kvcore, kvcore_cupy, kvcore_triton" 2>/dev/null; then
    "$PY" -c "import setuptools" 2>/dev/null ||
      "$PY" -m pip install --no-index --find-links "$WHEELS" setuptools || return 1
    "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . || return 1
  fi
  "$PY" -c "import kvcore, zmq, msgspec; print('kvcore importable')"
}

conformance() {
  local backend rc=0
  for backend in torch triton cupy; do
    echo "-- $backend"
    kvcore conformance --backend "$backend" --device cuda --profile quick || rc=1
  done
  return $rc
}

bench() {
  kvcore bench kernels --device cuda --json >"$OUT/bench.json"
}

export OUT WHEELS PY
export -f driver install conformance bench

# After the driver step said so (or when asked): Triton's CUDA 12.9 ptxas for sm_90.
choose_ptxas() {
  [[ -z ${TRITON_PTXAS_BLACKWELL_PATH:-} ]] || return 0
  grep -qs '^LEGACY_PTXAS' "$OUT/driver.log" || [[ ${KVCORE_LEGACY_PTXAS:-} == 1 ]] || return 0
  local dir
  dir=$("$PY" -c "import os, triton; print(os.path.dirname(triton.__file__))") || return 0
  export TRITON_PTXAS_BLACKWELL_PATH=$dir/backends/nvidia/bin/ptxas
}

steps=("$@")
((${#steps[@]})) || steps=(driver install ipc conformance gpu bench)
status=0
for s in "${steps[@]}"; do
  choose_ptxas
  case $s in
    driver) step driver driver.log 60 driver || status=1 ;;
    install) step install install.log 180 install || status=1 ;;
    ipc) step ipc ipc.log 180 "$PY" -m pytest -q -rs tests/test_client_gpu.py || status=1 ;;
    conformance) step conformance conformance.log 360 conformance || status=1 ;;
    gpu) step gpu gpu.log 300 "$PY" -m pytest -q -rs -m gpu \
      --ignore=tests/test_client_gpu.py tests || status=1 ;;
    bench) step bench bench.log 240 bench || status=1 ;;
    *) echo "unknown step: $s" >&2; exit 2 ;;
  esac
done
exit $status
