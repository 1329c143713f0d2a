#!/usr/bin/env bash
# The features suite: tests/mpi/mpi_features.cpp at every world size over MPI, then (HAVE_GLOO=1) over
# Gloo, mpirun only starting the ranks. Prints "features: P passed, F failed".
# Usage: features_suite.sh FEATURES_BIN
bin=$1
here=$(cd "$(dirname "$0")" && pwd)
MPIRUN=${MPIRUN:-mpirun}
tp=0 tf=0
add() {  # the last "label: P passed, F failed" line of $1
  local line
  line=$(grep -E '^[A-Za-z0-9_-]+: [0-9]+ passed, [0-9]+ failed' <<<"$1" | tail -n 1)
  if [ -z "$line" ]; then echo "features: $2 printed no summary"; tf=$((tf + 1)); return; fi
  tp=$((tp + $(sed -E 's/.*: ([0-9]+) passed.*/\1/' <<<"$line"))); tf=$((tf + $(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"$line")))
}
out=$("$here/run.sh" "$bin" mpi-features 2>&1)
echo "$out" | grep -vE '^(mpi-features\(np|$)' | tail -n 30; echo "$out" | grep -E '^mpi-features'; add "$out" mpi-features
if [ "${HAVE_GLOO:-0}" = 1 ]; then
  export DDP_TEST_GLOO="tcp://127.0.0.1:$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  out=$(MPIRUN="$MPIRUN -x DDP_TEST_GLOO" "$here/run.sh" "$bin" gloo-features 2>&1)
  echo "$out" | grep -vE '^(gloo-features\(np|$)' | tail -n 30; echo "$out" | grep -E '^gloo-features'; add "$out" gloo-features
fi
echo "features: $tp passed, $tf failed"
[ "$tf" -eq 0 ]
