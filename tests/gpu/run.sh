#!/usr/bin/env bash
# The GPU check, self-contained (no network): builds the library with CUDA, runs the GPU tests and the
# no-device test, then benchmarks flatten/unflatten against a device-to-device copy and prints the
# table last. Under 5 minutes on a GPU machine. Usage: tests/gpu/run.sh [BUILD dir]
set -u -o pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-${BUILD:-build}}
JOBS=${JOBS:-$(nproc)}
status=0
echo "== build ($BUILD)"
mkdir -p "$BUILD"
make BUILD="$BUILD" CUDA=1 -j"$JOBS" lib gpu-tests gpu-bench >"$BUILD/gpu-build.log" 2>&1 || {
  tail -n 40 "$BUILD/gpu-build.log"; echo "gpu: build failed"; exit 1; }
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; fi
echo "== GPU tests"
timeout 180 make --no-print-directory BUILD="$BUILD" CUDA=1 suite-gpu || status=1
echo "== no-device entry points"
timeout 60 make --no-print-directory BUILD="$BUILD" CUDA=1 suite-nccl-nodevice | tail -n 1 || status=1
echo "== bandwidth"
timeout 120 "$BUILD/tests/gpu_bench_flatten" || status=1
exit $status
