#!/usr/bin/env bash
# The ABI suite: what programs built against other headers than today's link against, then the
# programs themselves (each prints "<name>: N passed, N failed"); sums everything into
# "abi: N passed, N failed".
#   run.sh LIB OLD_HEADER OLD_CALLER PROGRAM...
lib=$1 old_header=$2 old_caller=$3; shift 2
tp=0; tf=0
pass() { tp=$((tp + 1)); }
fail() { tf=$((tf + 1)); echo "abi: FAIL $*"; }

# Every function the 0.1 header declares is still exported by the library (ddp_config_init included,
# which 0.2 made a macro: the symbol stays for programs built against 0.1).
exported=$(nm -D --defined-only "$lib" | awk '$2 == "T" { sub(/@.*/, "", $3); print $3 }')
old_fns=$(sed -n 's/^DDP_API .*[ *]\(ddp_[a-z0-9_]*\)(.*/\1/p' "$old_header")
n_old=0
for fn in $old_fns; do
  n_old=$((n_old + 1))
  if grep -qx "$fn" <<<"$exported"; then pass; else fail "$fn (declared by the 0.1 header) is not exported"; fi
done
if [ "$n_old" -ge 30 ]; then pass; else fail "only $n_old functions found in $old_header"; fi
echo "abi: the $n_old functions of the 0.1 header are exported by $(basename "$lib")"
if out=$(tests/check_exports.sh "$lib"); then pass; else echo "$out"; fail "tests/check_exports.sh"; fi

# The 0.1 program calls the exported ddp_config_init, and never ddp_get_bucket (see old_caller.c).
undef=$(nm -u "$old_caller" | awk '{ sub(/@.*/, "", $2); print $2 }')
if grep -qx ddp_config_init <<<"$undef"; then pass; else fail "the 0.1 program does not call the ddp_config_init symbol"; fi
if grep -qx ddp_get_bucket <<<"$undef"; then fail "the 0.1 program calls ddp_get_bucket"; else pass; fi
# Built against the 0.1 header, it needs the functions of 0.1 alone: the version node DDP_0.1.
needs=$(readelf -V "$old_caller" | grep -oE 'Name: DDP_[0-9.]+' | sed 's/Name: //' | sort -u | tr '\n' ' ')
if [ "$needs" = "DDP_0.1 " ]; then pass; else fail "the 0.1 program needs the version nodes '$needs', not DDP_0.1 alone"; fi

for bin in "$@"; do
  name=$(basename "$bin")
  out=$(timeout 120 "$bin" 2>&1)
  rc=$?
  # A sanitizer report starts with what was written where: show the start of a failing run's output.
  if [ "$rc" -ne 0 ]; then echo "$out" | head -n 60; else echo "$out" | tail -n 40; fi
  line=$(grep -E '^[a-z0-9-]+: [0-9]+ passed, [0-9]+ failed$' <<<"$out" | tail -n 1)
  if [ -z "$line" ]; then fail "$name ended without a summary (exit $rc)"; continue; fi
  p=$(sed -E 's/.*: ([0-9]+) passed.*/\1/' <<<"$line"); f=$(sed -E 's/.* ([0-9]+) failed$/\1/' <<<"$line")
  tp=$((tp + p)); tf=$((tf + f))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then fail "$name exited $rc with no failure counted"; fi
done
echo "abi: $tp passed, $tf failed"
[ "$tf" -eq 0 ]
