#!/usr/bin/env bash
# The GPU check, for one machine with an NVIDIA GPU, its driver, the CUDA toolkit and NCCL, and no
# network. Once, where there is network: tests/gpu/prepare.sh (doctest's header into .gpu-deps/, which
# travels with the tree). Then, on the GPU machine:
#   tests/gpu/run.sh [BUILD]          (default build-gpu; about 5 minutes on 16 cores, at most 8)
# checks the device (tests/gpu/check_device.cpp), builds the library with CUDA (MPI=0 GLOO=0), runs
# every GPU test case (one line each), the fault cases that fit one GPU, the no-device entry points,
# and the flatten/unflatten benchmark against the device's own cudaMemcpy D2D, and ends with the rows
# of docs/gpu.md's "last hardware run". It exits 1 when a step fails and when no usable GPU is found:
# that is a failure, never a skip (the build still runs first, so a machine without a GPU checks it).
#   tests/gpu/run.sh --check-device [BUILD]   builds and runs only the device check (seconds).
# JOBS (default nproc) is the build's parallelism; CUDA_HOME, NCCL_HOME as for make.
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 1
mode=all
if [ "${1:-}" = --check-device ]; then mode=check; shift; fi
BUILD=${1:-${BUILD:-build-gpu}}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$BUILD"
deps=$PWD/.gpu-deps/usr/include/doctest
if [ -f "$deps/doctest.h" ]; then doctest=$deps
elif [ -f /usr/include/doctest/doctest.h ]; then doctest=/usr/include/doctest
else doctest=; fi
mk=(make --no-print-directory BUILD="$BUILD" CUDA=1 MPI=0 GLOO=0 DOCTEST_CFLAGS="-I$doctest")
step() { echo "== $*"; }
die() { echo "gpu: FAILED: $*"; exit 1; }

step "device"
"${mk[@]}" gpu-probe >"$BUILD/gpu-probe.log" 2>&1 || { tail -n 20 "$BUILD/gpu-probe.log"; die "the device check did not build"; }
device=$("$BUILD/tests/gpu_check_device" 2>&1); device_rc=$?
echo "$device"
if [ "$mode" = check ]; then [ $device_rc -eq 0 ] || echo "gpu: FAILED: $device"; exit $device_rc; fi
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)

step "build ($BUILD, CUDA=1 MPI=0 GLOO=0, -j$JOBS)"
[ -n "$doctest" ] || die "doctest.h is not in .gpu-deps/ nor /usr/include/doctest: run tests/gpu/prepare.sh where there is network, and bring .gpu-deps/ along"
t0=$SECONDS
timeout 420 "${mk[@]}" -j"$JOBS" lib gpu-tests gpu-bench "$BUILD/tests/nccl_nodevice" >"$BUILD/gpu-build.log" 2>&1 ||
  { tail -n 40 "$BUILD/gpu-build.log"; die "the build failed (log: $BUILD/gpu-build.log)"; }
echo "built in $((SECONDS - t0)) s; $(grep -m1 '^libddp ' "$BUILD/gpu-build.log" || true)"
[ $device_rc -eq 0 ] || die "$device"

status=0
# One line per test case of a doctest JUnit report: "passed|FAILED|skipped<TAB>name".
cases() {
  awk '/<testcase /{ match($0, / name="[^"]*"/); n = substr($0, RSTART + 7, RLENGTH - 8)
         st = $0 ~ /status="skipped"/ ? "skipped" : "passed"; if ($0 ~ /\/>[ \t]*$/) { print st "\t" n; n = "" } next }
       /<failure|<error/ { if (n != "") st = "FAILED" }
       /<\/testcase>/ { if (n != "") print st "\t" n; n = "" }' "$1" |
    sed -e "s/&apos;/'/g" -e 's/&quot;/"/g' -e 's/&lt;/</g' -e 's/&gt;/>/g' -e 's/&amp;/\&/g'
}
step "GPU tests (world size 1 NCCL; every case must run and pass)"
xml=$BUILD/gpu-tests.xml
rm -f "$xml"
timeout 300 "$BUILD/tests/gpu_tests" --no-version -r=junit -o="$xml" >"$BUILD/gpu-tests.log" 2>&1; rc=$?
results=$( [ -f "$xml" ] && cases "$xml")
echo "$results"
# The fault cases that fit one GPU (NCCL refuses two ranks of one communicator on one GPU, so a peer
# that stalls or fails mid-collective needs two: those run only on the simulation, tests/gpusim).
faults=$(grep -E 'host pointer|never joins|bad arguments|check_finite' <<<"$results")
# doctest leaves skipped cases out of its report: count against the cases the sources declare.
want=$(cat tests/gpu/test_*.cpp | grep -c '^GPU_TEST_CASE(')
if [ $rc -ne 0 ] || grep -qv '^passed' <<<"$results" || [ "$(grep -c '^passed' <<<"$results")" -lt "$want" ]; then
  status=1
  grep -A12 '<failure' "$xml" 2>/dev/null | head -n 60
  tail -n 20 "$BUILD/gpu-tests.log"
  echo "gpu tests: exit $rc, $(grep -c '^passed' <<<"$results") of $want cases passed; every case must run and pass"
fi
step "no-device entry points (CUDA_VISIBLE_DEVICES=)"
nodevice=$(CUDA_VISIBLE_DEVICES='' timeout 60 "$BUILD/tests/nccl_nodevice" 1 2>&1); nrc=$?
tail -n 1 <<<"$nodevice"
[ $nrc -eq 0 ] || status=1
step "flatten/unflatten benchmark"
bench=$(timeout 180 "$BUILD/tests/gpu_bench_flatten" 2>&1); brc=$?
echo "$bench"
[ $brc -eq 0 ] && grep -q 'vs memcpy' <<<"$bench" || status=1
ratio() { awk -v w="$1" 'index($0, w) == 1 { print $NF }' <<<"$bench"; }

step "docs/gpu.md, last hardware run"
nccl=$(sed -n 's/.*; NCCL \(.*\)$/\1/p' <<<"$device")
cuda=$(sed -n 's/.*driver supports CUDA \([0-9.]*\), runtime CUDA \([0-9.]*\).*/runtime \2, driver up to \1/p' <<<"$device")
echo "| date | device | driver | CUDA | NCCL | GPU cases | fault cases | no-device | flatten plain | unflatten plain | flatten x0.5 | unflatten x2 |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
echo "| $(date -u +%F) | $(sed -n 's/^device: \(.*\), [0-9]* visible;.*/\1/p' <<<"$device") | ${driver:-?} | $cuda | $nccl |" \
  "$(grep -c '^passed' <<<"$results")/$(grep -c . <<<"$results") passed | $(grep -c '^passed' <<<"$faults")/$(grep -c . <<<"$faults") passed |" \
  "$([ $nrc -eq 0 ] && echo passed || echo FAILED) | $(ratio 'flatten, plain') | $(ratio 'unflatten, plain') |" \
  "$(ratio 'flatten, x0.5') | $(ratio 'unflatten, x2') |"
echo
echo "| case | result |"
echo "| --- | --- |"
awk -F'\t' '{ print "| " $2 " | " $1 " |" }' <<<"$results"
[ $status -eq 0 ] && echo "gpu: every step passed" || echo "gpu: FAILED (see above)"
exit $status
