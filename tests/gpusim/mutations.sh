#!/usr/bin/env bash
# Mutation runs of the gpusim suite (docs/gpu.md): each applies one change to the backend, rebuilds
# $BUILD (default build/gpusim: a GPUSIM=1 build folder of its own), runs the GPU tests and the
# multi-rank NCCL suite at np 2, reports which cases failed, and puts the file back. Run from a clean
# tree: it edits lib/ while it runs.
#   tests/gpusim/mutations.sh                          # build/gpusim
#   BUILD=build-x/gpusim tests/gpusim/mutations.sh     # another folder
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build/gpusim}
tmp=$(mktemp)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
run() {  # name file python-replacement
  name=$1 file=$2 old=$3 new=$4
  cp "$file" "$tmp"
  python3 - "$file" "$old" "$new" <<'PY'
import sys
p,old,new=sys.argv[1:4]; s=open(p).read()
assert old in s, "pattern not found: "+old
open(p,'w').write(s.replace(old,new,1))
PY
  make BUILD="$BUILD" CUDA=0 GPUSIM=1 -j2 "$BUILD/tests/gpu_tests" "$BUILD/tests/mpi_nccl" >/dev/null 2>&1 || echo "$name: build failed"
  g=$(DDP_GPUSIM_DEVICES=2 timeout 300 "$BUILD/tests/gpu_tests" --no-version 2>&1)
  m=$(DDP_GPUSIM_DEVICES=4 NP_LIST=2 timeout 300 tests/mpi/run.sh "$BUILD/tests/mpi_nccl" mpi-nccl 2>&1)
  echo "### $name"
  echo "$g" | grep -E "^TEST CASE:" | sort | uniq -c
  echo "$g" | grep -E "test cases:"
  echo "$m" | grep -E "^FAIL" | head -4
  echo "$m" | grep -E "^mpi-nccl:"
  cp "$tmp" "$file"
}
run "M1 drop the bucket stream's wait on the user's stream" lib/backends/cuda/cuda_device.cpp \
  '  DDP_CUDA_CHECK(cudaStreamWaitEvent(c.stream(), c.in_event(), 0));' ''
run "M2 upload a table on the legacy stream, not after the bucket stream's previous launch" lib/backends/cuda/device_tables.cpp \
  'DDP_CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), size(), cudaMemcpyHostToDevice, stream));' \
  'DDP_CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), size(), cudaMemcpyHostToDevice, nullptr));'
run "M3 apply the pre-divide twice (fused and in the pack)" lib/core/reducer.cpp \
  '    red_ = Reduction{RedOp::PreMulSum, pre_};
    pre_ = 1.0;' '    red_ = Reduction{RedOp::PreMulSum, pre_};'
run "M4 leave one in-place grad out of a bucket's group" lib/core/reducer.cpp \
  '  for (Segment& seg : r.direct.segs) c.allreduce(seg.ptr, seg.ptr, seg.numel, bk.dtype, r.red, s, dl);' \
  '  for (size_t i = 0; i + (group ? 1 : 0) < r.direct.segs.size(); ++i) {
    Segment& seg = r.direct.segs[i];
    c.allreduce(seg.ptr, seg.ptr, seg.numel, bk.dtype, r.red, s, dl);
  }'
run "M5 zero new device buffers with cudaMemset on the legacy stream (asynchronous, not ordered with the bucket streams)" \
  lib/backends/cuda/cuda_device.cpp \
  '  DDP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, setup_));
  DDP_CUDA_CHECK(cudaStreamSynchronize(setup_));' \
  '  DDP_CUDA_CHECK(cudaMemset(p, 0, bytes));'
make BUILD="$BUILD" CUDA=0 GPUSIM=1 -j2 "$BUILD/tests/gpu_tests" "$BUILD/tests/mpi_nccl" >/dev/null 2>&1
echo "### restored"
