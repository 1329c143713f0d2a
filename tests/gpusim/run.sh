#!/usr/bin/env bash
# The gpusim suite: the GPU tests, the multi-rank reduction, shard and features suites over the
# simulated NCCL, the elastic NCCL scenarios, the example trainer's CUDA variant on 2 ranks (both
# layouts), and the GPU tests again under TSan (not the MPI-based parts: TSan cannot see the
# ordering that Open MPI's shared-memory transport gives, and reports its copies as races). Each part
# prints "name: P passed, F failed[, S skipped]"; the last line sums them:
#   "gpusim: P passed, F failed, S skipped"
# Usage: tests/gpusim/run.sh GPU_TESTS MPI_NCCL_BIN TRAINER_BIN (env: BUILD, MPIRUN, TSAN_BUILD, MAKE_CMD,
# SHARD_BIN: the shard suite's binary, FEATURES_BIN: the features suite's, ELASTIC_BIN: elastic_nccl's)
gpu_bin=$1 mpi_bin=$2 demo_bin=$3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export DDP_GPUSIM_SEED=${DDP_GPUSIM_SEED:-$(date +%s)}
echo "gpusim: seed $DDP_GPUSIM_SEED (DDP_GPUSIM_SEED), random delays up to ${DDP_GPUSIM_DELAY_US:-100} us per operation"
tp=0 tf=0 ts=0
add() {  # the last "P passed, F failed[, S skipped]" line of $1
  local line p f s
  line=$(grep -E '^[A-Za-z0-9_-]+: [0-9]+ passed, [0-9]+ failed' <<<"$1" | tail -n 1)
  if [ -z "$line" ]; then echo "gpusim: $2 printed no summary"; tf=$((tf + 1)); return; fi
  p=$(sed -E 's/.*: ([0-9]+) passed.*/\1/' <<<"$line"); f=$(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"$line")
  s=$(grep -oE '[0-9]+ skipped' <<<"$line" | grep -oE '[0-9]+' || echo 0)
  [ "$3" -ne 0 ] && [ "$f" -eq 0 ] && f=1
  tp=$((tp + p)); tf=$((tf + f)); ts=$((ts + s))
}

echo "== GPU tests (tests/gpu) on the simulation"
out=$(DDP_GPUSIM_DEVICES=2 timeout 600 "$root/tests/gpu/suite.sh" "$gpu_bin" 2>&1); rc=$?
echo "$out" | tail -n 25
add "$out" "gpu" $rc

nccl_part() {  # a multi-rank suite's binary $2 over the simulated NCCL at every world size, label $3
  local out rc
  echo "== $1 over the simulated NCCL"
  out=$(DDP_GPUSIM_DEVICES=4 MPIRUN="$MPIRUN" "$root/tests/mpi/run.sh" "$2" "$3" 2>&1); rc=$?
  echo "$out" | tail -n 25
  add "$out" "$3" $rc
}
nccl_part "the multi-rank reduction suite" "$mpi_bin" mpi-nccl
if [ -n "${SHARD_BIN:-}" ]; then nccl_part "the multi-rank shard suite" "$SHARD_BIN" mpi-nccl-shard; fi
if [ -n "${FEATURES_BIN:-}" ]; then nccl_part "the features suite" "$FEATURES_BIN" mpi-nccl-features; fi

if [ -n "${ELASTIC_BIN:-}" ]; then
  echo "== elastic NCCL: a rank killed, a rank joining (tests/gpusim/run_elastic.sh)"
  out=$(MPIRUN="$MPIRUN" "$here/run_elastic.sh" "$ELASTIC_BIN" 2>&1); rc=$?
  echo "$out" | tail -n 40
  add "$out" "elastic-nccl" $rc
fi

echo "== the example trainer, CUDA variant, 2 ranks over the simulated NCCL"
p=0 f=0
for layout in arena copy; do
  out=$(DDP_GPUSIM_DEVICES=2 timeout 300 $MPIRUN --oversubscribe -np 2 "$demo_bin" --comm nccl --layout $layout \
        --steps 4 --batch 8 --quiet 2>&1); rc=$?
  echo "$out" | tail -n 4
  if [ $rc -eq 0 ]; then p=$((p + 1)); else f=$((f + 1)); echo "trainer ($layout): exit $rc"; fi
done
add "trainer-cuda: $p passed, $f failed" "trainer" 0

if [ -n "${TSAN_BUILD:-}" ]; then
  echo "== GPU tests under TSan ($TSAN_BUILD)"
  out=$(cd "$root" && TSAN_OPTIONS="halt_on_error=1 suppressions=$here/tsan.supp" \
        timeout 900 ${MAKE_CMD:-make} BUILD="$TSAN_BUILD" CUDA=0 GPUSIM=1 SANITIZE=thread gpusim-gpu 2>&1); rc=$?
  echo "$out" | tail -n 25
  if grep -qE 'WARNING: ThreadSanitizer|ERROR: ThreadSanitizer' <<<"$out"; then
    echo "gpusim: TSan reports above"; tf=$((tf + 1))
  fi
  add "$(sed 's/^gpu:/gpu-tsan:/' <<<"$out")" "gpu-tsan" $rc
fi
echo "gpusim: $tp passed, $tf failed, $ts skipped"
[ "$tf" -eq 0 ]
