#!/usr/bin/env bash
# The shared library exports the API alone, each function in the version node of the release that
# added it (lib/libddp.map):
#   - every defined dynamic symbol is a ddp_ function (or the symbol ld makes for a version node)
#   - the soname is libddp.so.<major>
#   - every DDP_API function of the header is exported, nothing else is, and each carries a node
#   - the functions of the 0.1 header are in DDP_0.1, and DDP_0.1 holds nothing else
#   - every other function is in a node after DDP_0.1 and none after the header's version
#   - each node inherits the one before it, and none is empty
#   - a program that uses a function of a node, run on a library made of the nodes before it, is
#     refused at load time ("version `DDP_0.2' not found"); one that uses 0.1 functions alone needs
#     DDP_0.1 alone
# Usage: check_exports.sh LIB [HEADER [OLD_HEADER]]   (defaults include/ddp.h, tests/abi/ddp_v0_1.h)
lib=$1; header=${2:-include/ddp.h}; old_header=${3:-tests/abi/ddp_v0_1.h}
CC=${CC:-cc}
pass=0; fail=0
ok() { pass=$((pass + 1)); }
bad() { echo "exports: FAIL $*"; fail=$((fail + 1)); }
finish() { echo "exports: $pass passed, $fail failed"; [ "$fail" -eq 0 ]; exit; }

# The DDP_API functions a header declares, in order (comments stripped first).
api_functions() {
  perl -0777 -ne 's{/\*.*?\*/}{ }gs; s{//[^\n]*}{ }g; print "$1\n" while /\bDDP_API\b[^;(){}]*?\b(ddp_\w+)\s*\(/g' "$1"
}
# "major.minor" of a node name DDP_<major>.<minor>, as a number that sorts: 0.2 -> 2, 1.0 -> 1000.
node_rank() { awk -F'[_.]' '{ print $2 * 1000 + $3 }' <<<"$1"; }

# Defined dynamic symbols as "name version" (version empty when the symbol has none). readelf
# writes a versioned name as name@@VERSION (the default) or name@VERSION.
# Leaves out the symbol ld defines for each version node: an absolute OBJECT named after the node.
exports=$(readelf -W --dyn-syms "$lib" | awk '$1 ~ /^[0-9]+:$/ && $7 != "UND" && $8 != "" {
  n = $8; sub(/@.*/, "", n); v = ""; if ($8 ~ /@/) { v = $8; sub(/^[^@]*@+/, "", v) }
  if (!($4 == "OBJECT" && $7 == "ABS" && n ~ /^DDP_[0-9]+\.[0-9]+$/ && (v == "" || v == n))) print n, v }')
if [ -z "$exports" ]; then bad "readelf found no defined dynamic symbol in $lib"; finish; fi

stray=$(awk '$1 !~ /^ddp_/ { print $1 }' <<<"$exports")
if [ -z "$stray" ]; then ok; else bad "symbols outside the API:"; head -20 <<<"$stray"; fi

soname=$(readelf -d "$lib" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
case "$soname" in
  libddp.so.[0-9]*) ok ;;
  *) bad "soname '$soname' is not libddp.so.<major>" ;;
esac

unversioned=$(awk '$2 == "" { print $1 }' <<<"$exports")
if [ -z "$unversioned" ]; then ok; else bad "exported without a version node (lib/libddp.map):" $unversioned; fi

major=$(sed -n 's/^#define DDP_VERSION_MAJOR \([0-9]*\).*/\1/p' "$header")
minor=$(sed -n 's/^#define DDP_VERSION_MINOR \([0-9]*\).*/\1/p' "$header")
newest=$(node_rank "DDP_$major.$minor")
declared=$(api_functions "$header")
old=$(api_functions "$old_header")
if [ "$(wc -l <<<"$declared")" -ge 40 ] && [ "$(wc -l <<<"$old")" -ge 30 ]; then ok
else bad "too few DDP_API functions found in $header or $old_header"; fi

for fn in $declared; do
  ver=$(awk -v f="$fn" '$1 == f { print $2 }' <<<"$exports")
  if [ -z "$(awk -v f="$fn" '$1 == f' <<<"$exports")" ]; then
    bad "$fn (declared by $header) is not exported: add it to lib/libddp.map, in the node DDP_$major.$minor"
  elif [ -z "$ver" ]; then
    : # counted above
  elif grep -qx "$fn" <<<"$old"; then
    if [ "$ver" = DDP_0.1 ]; then ok; else bad "$fn is a 0.1 function but is in $ver, not DDP_0.1"; fi
  elif [ "$ver" = DDP_0.1 ]; then
    bad "$fn is in DDP_0.1, but the 0.1 header ($old_header) has no such function"
  elif [ "$(node_rank "$ver")" -gt "$newest" ]; then
    bad "$fn is in $ver, after this library's version $major.$minor (include/ddp.h): a function goes into the node of the release that adds it"
  else ok; fi
done
extra=$(awk '{ print $1 }' <<<"$exports" | grep -vxF -f <(echo "$declared") || true)
if [ -z "$extra" ]; then ok; else bad "exported but not declared DDP_API in $header:" $extra; fi

# The nodes, oldest first, each with its parent (readelf -V: the version definition section).
chain=$(readelf -V "$lib" | awk '/^Version definition section/ { d = 1; next } /^Version needs section/ { d = 0 }
  d && /Name: DDP_/ { sub(/.*Name: /, ""); name = $1; print name } d && /Parent 1: / && name != "" { sub(/.*Parent 1: /, ""); print "  " $1 }')
nodes=$(grep -v '^  ' <<<"$chain")
if [ "$(head -n1 <<<"$nodes")" = DDP_0.1 ]; then ok; else bad "the first version node is '$(head -n1 <<<"$nodes")', not DDP_0.1"; fi
prev=""
for n in $nodes; do
  parent=$(awk -v n="$n" '$0 == n { getline p; if (p ~ /^  /) { sub(/^ +/, "", p); print p } }' <<<"$chain")
  if [ "$parent" = "$prev" ]; then ok; else bad "node $n inherits '${parent}', not '${prev}'"; fi
  if awk -v n="$n" '$2 == n { found = 1 } END { exit !found }' <<<"$exports"; then ok
  else bad "node $n is empty: a newer program would load on this library and fail at its first call"; fi
  prev=$n
done

# Old libraries, made here: for each node after the first, a stand-in library with the nodes before it
# (empty functions under the same soname); a program that uses the node's first function is refused
# by it at load time, and loads on the real library.
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
libdir=$(cd "$(dirname "$lib")" && pwd)
probe() { # probe NAME FUNCTION...: a program that takes the address of each function
  { for f in "${@:2}"; do echo "extern void $f(void);"; done
    echo "int main(void) { void (*volatile p)(void) = 0; int n = 0;"
    for f in "${@:2}"; do echo "  p = $f; n += p != 0;"; done
    echo "  return n == $(($# - 1)) ? 0 : 1; }"; } > "$work/$1.c"
  $CC -o "$work/$1" "$work/$1.c" "$lib" 2>"$work/$1.log" || { cat "$work/$1.log"; return 1; }
}
# A sanitizer build of the library needs its runtime loaded first: preload it for the programs run on it.
preload=""
for rt in $(readelf -d "$lib" | sed -n 's/.*NEEDED.*\[\(lib[at]san\.so[.0-9]*\)\].*/\1/p'); do
  preload="$preload $($CC -print-file-name="$rt")"
done
on_lib() { LD_LIBRARY_PATH=$libdir LD_PRELOAD="${preload# }" "$@"; }
before=""
for n in $nodes; do
  fn=$(awk -v n="$n" '$2 == n { print $1; exit }' <<<"$exports")
  if [ -n "$before" ] && [ -n "$fn" ]; then
    stub=$work/stub-$n; mkdir -p "$stub"
    awk -v keep="$before" 'BEGIN { split(keep, k, " "); for (i in k) want[k[i]] = 1 } want[$2] { print "void " $1 "(void) {}" }' \
      <<<"$exports" > "$stub/stub.c"
    prev_node=""
    for b in $before; do
      echo "$b { global:"; awk -v b="$b" '$2 == b { print "  " $1 ";" }' <<<"$exports"
      if [ -z "$prev_node" ]; then echo "local: *; };"; else echo "} $prev_node;"; fi
      prev_node=$b
    done > "$stub/stub.map"
    if ! $CC -shared -fPIC -o "$stub/$soname" "$stub/stub.c" -Wl,-soname,"$soname" \
         -Wl,--version-script="$stub/stub.map" 2>"$stub/log"; then
      cat "$stub/log"; bad "could not build a stand-in library of$before"
    elif probe "uses-$n" "$fn"; then
      out=$(LD_LIBRARY_PATH=$stub "$work/uses-$n" 2>&1); rc=$?
      if [ "$rc" -ne 0 ] && grep -q "version \`$n' not found" <<<"$out"; then ok
      else bad "a program using $fn ($n) on a library of$before: exit $rc, '$out' (want: version \`$n' not found)"; fi
      if on_lib "$work/uses-$n"; then ok; else bad "a program using $fn does not run on $lib"; fi
    else bad "could not link a program using $fn"; fi
  fi
  before="$before $n"
done
if probe uses-0.1 $old; then
  needs=$(readelf -V "$work/uses-0.1" | grep -oE 'Name: DDP_[0-9.]+' | sed 's/Name: //' | sort -u | tr '\n' ' ')
  if [ "$needs" = "DDP_0.1 " ]; then ok; else bad "a program using the 0.1 functions needs '$needs', not DDP_0.1 alone"; fi
  if on_lib "$work/uses-0.1"; then ok; else bad "a program using the 0.1 functions does not run"; fi
else bad "could not link a program using the 0.1 functions"; fi

echo "exports: $(wc -l <<<"$exports") functions in $(echo $nodes | wc -w) version nodes ($(echo $nodes)), soname $soname"
finish
