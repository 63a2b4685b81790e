#!/usr/bin/env bash
# gpu_check.sh: the one prepared check for the GPU machine (no network there; its python3 has torch, numba,
# pybind11, pytest and nvcc). Builds nanscan with its CUDA part for sm_90, runs the CUDA tests, then
# benchmarks/bench_gpu.py, and leaves everything under $OUT (at most 8 files):
#   summary.txt      one line per step: its exit code and seconds (a failed step does not stop the next)
#   env.txt          nvidia-smi, python, torch, nvcc versions
#   build.log        pip install output; ptxas.txt: registers, shared memory and spills of each kernel
#   pytest.log       the CUDA tests (pytest -k cuda: the `cuda` marker and the cuda backend parameter)
#   bench.log        the benchmark's tables and ratio lines (the scan against torch, then Monitor.check in
#                    mode="async" in a GPT-2-medium training step: monitor_async_overhead); bench_gpu.json
#   sass_sm90.txt    the scan kernel's machine code, for reading its inner loop offline
# Dry run on a machine without a GPU: DRY_RUN=1 OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh uses the installed
# build (no rebuild), skips nvidia-smi and the machine code dump, runs the same pytest selection (its GPU tests
# skip, so the run shows what would be collected) and bench_gpu.py --dry-run: every step's logic and command line
# are exercised before a device is spent on them.
# Usage: OUT=/some/dir bash benchmarks/gpu_check.sh   (about 4 minutes expected; the step limits add up to
# 515 s, inside the device tool's 600 s per command and leaving a session's 15 device minutes room for the
# machine's start; bench_gpu.json is written after the scan part too, so a monitor part cut short keeps it)
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
PY=${PYTHON:-python3}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 NANSCAN_CUDA=1 NANSCAN_CUDA_ARCH=90
# The build tree nvcc writes its objects to (setup.py, NativeBuild._compile_cuda).
CUDA_BUILD_DIR=build/nanscan-cuda

# step NAME SECONDS LOG COMMAND...: runs COMMAND under a time limit with its output in LOG, records its exit code.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local note=""
  [ "$rc" = 124 ] && note=" (stopped at its ${limit}s limit)"
  echo "$name rc=$rc seconds=$((SECONDS - start))$note" | tee -a "$SUMMARY"
  return 0
}

env_report() {
  if [ "$DRY_RUN" != 1 ]; then
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  fi
  "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda,
"gpu", torch.cuda.is_available() and torch.cuda.get_device_name())'
  nvcc --version
}

register_report() {
  nvcc -c csrc/cuda/scan_cuda.cu -o /tmp/nanscan_ptxas.o -O3 -std=c++17 --expt-relaxed-constexpr -Icsrc/include \
    -Icsrc -gencode=arch=compute_90,code=sm_90 -Xptxas -v
}

sass_report() {
  local obj
  obj=$(ls -t "$CUDA_BUILD_DIR"/*/scan_cuda.o | head -n 1)
  echo "# $obj"
  cuobjdump --dump-sass "$obj"
}

export -f env_report register_report sass_report
export PY CUDA_BUILD_DIR DRY_RUN
BENCH_DRY=()
step env 20 "$OUT/env.txt" bash -c env_report
if [ "$DRY_RUN" = 1 ]; then
  step import 30 "$OUT/build.log" "$PY" -c 'import nanscan._C as C; info = C.build_info(); print(info)
assert info["cuda"], "built without CUDA"; print("dry run: cuda_probe skipped", C.cuda_layout())'
  BENCH_DRY=(--dry-run)
else
  step build 140 "$OUT/build.log" "$PY" -m pip install --no-build-isolation --no-deps -e .
  step import 30 "$OUT/build.log" "$PY" -c 'import nanscan._C as C, torch
info = C.build_info(); print(info); assert info["cuda"], "built without CUDA"
C.cuda_probe(torch.cuda.current_device()); print("cuda_probe ok", C.cuda_layout())'
fi
step ptxas 45 "$OUT/ptxas.txt" bash -c register_report
# -k cuda: the `cuda`-marked tests and every other test parametrized over the cuda backend
step pytest 110 "$OUT/pytest.log" "$PY" -m pytest -k cuda -q -rs -p no:cacheprovider tests
step bench 150 "$OUT/bench.log" "$PY" benchmarks/bench_gpu.py --part all --rounds 1 --gpt-blocks 4 \
  --json "$OUT/bench_gpu.json" "${BENCH_DRY[@]}"
[ "$DRY_RUN" = 1 ] || step sass 20 "$OUT/sass_sm90.txt" bash -c sass_report

echo "--- summary"
cat "$SUMMARY"
echo "--- pytest (tail)"
tail -n 15 "$OUT/pytest.log"
echo "--- bench"
cat "$OUT/bench.log"
