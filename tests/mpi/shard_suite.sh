#!/usr/bin/env bash
# The shard suite: the multi-rank shard tests and the C training loop (sharded against allreduced)
# at every world size of NP_LIST, and the guide's program (docs/sharded.md) extracted, compiled and
# run on 2 and 3 ranks. Prints "shard: P passed, F failed".
# With TRAINER (the example trainer), also: --shard --optimizer adam must print the losses and test
# accuracy of the unsharded run, with half the optimizer state, at 2 ranks.
# Usage: shard_suite.sh SHARD_TEST_BIN TRAIN_BIN BUILD_DIR [TRAINER]
test_bin=$1 train_bin=$2 build=$3 trainer=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
tp=0 tf=0
add() {  # the last "label: P passed, F failed" line of $1
  local line
  line=$(grep -E '^[A-Za-z0-9_-]+: [0-9]+ passed, [0-9]+ failed' <<<"$1" | tail -n 1)
  if [ -z "$line" ]; then echo "shard: $2 printed no summary"; tf=$((tf + 1)); return; fi
  tp=$((tp + $(sed -E 's/.*: ([0-9]+) passed.*/\1/' <<<"$line"))); tf=$((tf + $(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"$line")))
}
out=$(MPIRUN="$MPIRUN" "$here/run.sh" "$test_bin" mpi-shard 2>&1); echo "$out" | tail -n 6; add "$out" mpi-shard
# The ring cuts each chunk into pieces of the host piece size: small pieces, many per chunk, at 3 ranks.
out=$(DDP_HOST_PIECE_BYTES=4100 timeout 300 $MPIRUN --oversubscribe -np 3 -x DDP_HOST_PIECE_BYTES "$test_bin" 2>&1)
echo "$out" | tail -n 2 | sed 's/^/small pieces: /'; add "$(sed 's/^mpi-shard(np=3[^:]*)/mpi-shard-pieces/' <<<"$out")" mpi-shard-pieces
out=$(MPIRUN="$MPIRUN" "$here/run.sh" "$train_bin" shard-train 2>&1); echo "$out" | tail -n 6; add "$out" shard-train
src="$build/tests/guide_sharded.c"
awk '/^```c$/{on=1; next} /^```$/{on=0} on' "$root/docs/sharded.md" > "$src"
# GUIDE_CFLAGS: the sanitizer flags of a sanitized build (its library needs their runtime first).
if mpicc -std=c99 -Wall -Werror ${GUIDE_CFLAGS:-} -I"$root/include" "$src" -o "$build/tests/guide_sharded" -L"$build/lib" -lddp \
     -Wl,-rpath,"$(cd "$build/lib" && pwd)"; then
  for np in 2 3; do
    out=$(timeout 120 $MPIRUN --oversubscribe -np $np "$build/tests/guide_sharded" 2>&1); rc=$?
    lines=$(grep -E '^rank [0-9]+: param' <<<"$out" | sed -E 's/^rank [0-9]+: //' | sort -u | wc -l)
    if [ $rc -eq 0 ] && [ "$(grep -cE '^rank [0-9]+: param' <<<"$out")" -eq $np ] && [ "$lines" -eq 1 ]; then
      tp=$((tp + 1)); echo "guide (np=$np): $(grep -E '^rank 0' <<<"$out")"
    else
      tf=$((tf + 1)); echo "guide (np=$np) FAILED (exit $rc):"; echo "$out" | tail -n 10
    fi
  done
else
  tf=$((tf + 1)); echo "guide: docs/sharded.md's program does not compile"
fi
if [ -n "$trainer" ]; then
  run_trainer() { timeout 300 $MPIRUN --oversubscribe -np 2 "$trainer" --steps 4 --batch 16 --lr 0.001 --quiet \
                    --optimizer adam "$@" 2>&1; }
  plain=$(run_trainer); rc1=$?
  sharded=$(run_trainer --shard); rc2=$?
  want=$(grep -E '^loss .* ->' <<<"$plain"); got=$(grep -E '^loss .* ->' <<<"$sharded")
  state=$(grep -E '^optimizer adam, sharded' <<<"$sharded")
  echo "trainer: $state"
  if [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && [ -n "$want" ] && [ "$want" = "$got" ]; then
    tp=$((tp + 1)); echo "trainer --shard: $got (the same as unsharded)"
  else
    tf=$((tf + 1)); echo "trainer --shard FAILED (exit $rc1/$rc2): '$got' vs '$want'"; echo "$sharded" | tail -n 8
  fi
fi
echo "shard: $tp passed, $tf failed"
[ "$tf" -eq 0 ]
