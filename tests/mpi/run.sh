#!/usr/bin/env bash
# Runs the multi-rank test binary at every world size of NP_LIST and sums rank 0's summaries.
# A run is bounded in time; a hang counts as a failure.
bin=$1
label=${2:-mpi}  # the summary's label: mpi, or mpi-nccl for the simulated GPU build
MPIRUN=${MPIRUN:-mpirun}
# mpirun refuses root unless told so.
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
seed=${DDP_TEST_SEED:-$(date +%s)}
tp=0; tf=0
for np in ${NP_LIST:-1 2 3 4}; do
  out=$(timeout 300 $MPIRUN --oversubscribe -np "$np" "$bin" "$seed" 2>&1)
  rc=$?
  echo "$out" | grep -v '^$' | tail -n 40
  line=$(echo "$out" | grep -E "^$label\\(np=" | tail -n 1)
  if [ -z "$line" ]; then echo "$label: np=$np ended without a summary (exit $rc)"; tf=$((tf + 1)); continue; fi
  p=$(echo "$line" | sed -E 's/.*: ([0-9]+) passed.*/\1/'); f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
  [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && f=1
  tp=$((tp + p)); tf=$((tf + f))
done
echo "$label: $tp passed, $tf failed"
[ "$tf" -eq 0 ]
