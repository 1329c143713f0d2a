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
# Inside lib/core, the same rule by module (a file's name without its extension; a+b+c: files b and c
# are module a's private parts), lowest layer first: a module includes only modules of its own layer
# or below, and no two modules include each other. A new file must be placed here. (docs/design.md,
# "Layers", says what each layer is.)
core_layers=(
  "base: common knobs log inspector host_reduce stragglers timeline config"
  "backend interfaces: backend comms launcher join_protocol"
  "planning: plan program"
  "reduction: int8_wire shard_set reducer+bucket_runtime+bucket_steps agreement joins"
  "membership: generation elastic"
  "context: context iteration collectives recovery admission sharding stats stall_inspector"
  "shell: handles shell api_comms api_context api_hooks"
)
declare -A layer_of module_of
for i in "${!core_layers[@]}"; do
  for entry in ${core_layers[$i]#*:}; do
    IFS=+ read -ra parts <<<"$entry"
    for part in "${parts[@]}"; do layer_of[$part]=$i; module_of[$part]=${parts[0]}; done
  done
done
declare -A includes
bad_core=""
for f in $core; do
  m=$(basename "$f"); m=${m%.*}
  if [ -z "${layer_of[$m]:-}" ]; then bad_core+="  $f: module '$m' has no layer (tests/check_layers.sh)"$'\n'; continue; fi
  m=${module_of[$m]}
  for inc in $(sed -nE 's|^[[:space:]]*#[[:space:]]*include[[:space:]]*"core/([a-z0-9_]+)\.hpp".*|\1|p' "$f"); do
    [ -n "${module_of[$inc]:-}" ] && inc=${module_of[$inc]}
    [ "$inc" = "$m" ] && continue
    includes[$m]+=" $inc"
    if [ -z "${layer_of[$inc]:-}" ]; then bad_core+="  $f includes core/$inc.hpp, which has no layer"$'\n'
    elif [ "${layer_of[$inc]}" -gt "${layer_of[$m]}" ]; then
      bad_core+="  $f ($(cut -d: -f1 <<<"${core_layers[${layer_of[$m]}]}")) includes core/$inc.hpp ($(cut -d: -f1 <<<"${core_layers[${layer_of[$inc]}]}")): up a layer"$'\n'
    fi
  done
done
for m in "${!includes[@]}"; do
  for inc in ${includes[$m]}; do
    if [[ " ${includes[$inc]:-} " == *" $m "* ]] && [[ "$m" < "$inc" ]]; then bad_core+="  core/$m and core/$inc include each other"$'\n'; fi
  done
done
if [ -n "$bad_core" ]; then
  echo "layers: lib/core modules include up a layer:"; printf '%s' "$bad_core"; fail=$((fail + 1))
else
  pass=$((pass + 1))
fi
[ -z "$core" ] && { echo "layers: no files under $lib/core"; fail=$((fail + 1)); }
[ -z "$host" ] && { echo "layers: no files under $lib/host"; fail=$((fail + 1)); }
echo "layers: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
