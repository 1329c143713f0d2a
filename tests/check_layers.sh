#!/usr/bin/env bash
# The layers of lib/ point one way: the core (lib/core) never includes a backend (lib/backends), the
# host runtime (lib/host) nor a CUDA, NCCL or MPI header; the host runtime never includes a backend;
# a backend never includes another backend's header (the host runtime is not a backend: the host
# memory communicators share it). Usage: tests/check_layers.sh [lib-dir]
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
pat='backends/|host/|mpi\.h|nccl\.h|cuda|cub/'
check "core files include backend or host runtime headers" $core
host=$(find "$lib/host" -name '*.[ch]pp')
pat='backends/|mpi\.h|nccl\.h|cuda|cub/'
check "host runtime files include backend headers" $host
for b in "$lib"/backends/*/; do
  name=$(basename "$b")
  files=$(find "$b" -name '*.[ch]pp')
  # the other backends' headers
  others=$(ls "$lib/backends" | grep -vx "$name" | sed 's|^|backends/|; s|$|/|' | paste -sd'|')
  [ -z "$others" ] && continue
  pat=$others
  check "backend '$name' includes another backend's headers" $files
done
[ -z "$core" ] && { echo "layers: no files under $lib/core"; fail=$((fail + 1)); }
[ -z "$host" ] && { echo "layers: no files under $lib/host"; fail=$((fail + 1)); }
echo "layers: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
