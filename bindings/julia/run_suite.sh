#!/usr/bin/env bash
# The julia suite: test/runtests.jl on one rank, then test/mpi.jl under mpirun -np 2.
# Usage: run_suite.sh JULIA (LIBDDP_PATH, MPIRUN and HAVE_GLOO=1 (also over Gloo) from the environment).
julia=${1:-julia}
cd "$(dirname "$0")"
out=$(timeout 300 "$julia" --startup-file=no test/runtests.jl 2>&1); rc=$?
echo "$out"
line=$(grep -E '^julia: [0-9]+ passed' <<<"$out" | tail -n1)
p=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+'); f=$(grep -oE '[0-9]+ failed' <<<"$line" | grep -oE '[0-9]+')
p=${p:-0}; f=${f:-1}; [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && f=1
s=0
if [ -n "$MPIRUN" ]; then
  m=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 300 $MPIRUN --oversubscribe -np 2 \
      "$julia" --startup-file=no test/mpi.jl 2>&1); mrc=$?
  echo "$m"
  if [ "$mrc" -eq 0 ] && [ "$(grep -c 'julia mpi ok' <<<"$m")" -eq 2 ]; then p=$((p + 1)); else f=$((f + 1)); fi
else
  s=1
fi
# The same over Gloo, started without mpirun (tools/ddp_launch sets what torchrun sets).
if [ "${HAVE_GLOO:-0}" = 1 ] && [ -x ../../tools/ddp_launch ]; then
  m=$(LIBDDP_TEST_GLOO=env:// MASTER_ADDR=127.0.0.1 timeout 300 ../../tools/ddp_launch -n 2 \
      "$julia" --startup-file=no test/mpi.jl 2>&1); mrc=$?
  echo "$m"
  if [ "$mrc" -eq 0 ] && [ "$(grep -c 'julia mpi ok' <<<"$m")" -eq 2 ]; then p=$((p + 1)); else f=$((f + 1)); fi
fi
echo "julia: $p passed, $f failed, $s skipped"
[ "$f" -eq 0 ]
