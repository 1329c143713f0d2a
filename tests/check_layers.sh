#!/usr/bin/env bash
# The layers of lib/ point one way: the core (lib/core) never includes a backend (lib/backends) nor a
# CUDA, NCCL or MPI header; a backend never includes another backend's header except the host device,
# which every host-memory communicator brings. Usage: tests/check_layers.sh [lib-dir]
lib=${1:-lib}
pass=0; fail=0
check() {  # check NAME FILES... : each file's #include lines against the forbidden pattern $pat
  local name=$1; shift
  local bad
  bad=$(grep -nHE "^[[:space:]]*#[[:space:]]*include[[:space:]]*[<\"]($pat)" "$@" 2>/dev/null)
  if [ -n "$bad" ]; then
    echo "layers: $name:"; echo "$bad" | sed 's/^/  /'; fail=$((fail + 1))
  else
    pass=$((pass + 1))
  fi
}
core=$(find "$lib/core" -name '*.[ch]pp')
pat='backends/|mpi\.h|nccl\.h|cuda|cub/'
check "core files include backend headers" $core
for b in "$lib"/backends/*/; do
  name=$(basename "$b")
  files=$(find "$b" -name '*.[ch]pp')
  # the backends' own headers, less this one's and the host device's
  others=$(ls "$lib/backends" | grep -vxE "$name|host" | sed 's|^|backends/|; s|$|/|' | paste -sd'|')
  [ -z "$others" ] && continue
  pat=$others
  check "backend '$name' includes another backend's headers" $files
done
[ -z "$core" ] && { echo "layers: no files under $lib/core"; fail=$((fail + 1)); }
echo "layers: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
