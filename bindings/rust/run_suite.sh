#!/usr/bin/env bash
# The rust suite: cargo test --offline on one rank, then the MPI test under mpirun -np 2.
# Usage: [HAVE_GLOO=1] run_suite.sh LIBDIR TARGETDIR [MPIRUN] (HAVE_GLOO=1: also over Gloo, no mpirun). Ends with "rust: N passed, N failed, N skipped".
libdir=$1; target=$2; mpirun=${3:-}
cd "$(dirname "$0")"
if ! command -v cargo >/dev/null 2>&1; then
  echo "rust: skipped: cargo is not on PATH"; echo "rust: 0 passed, 0 failed, 1 skipped"; exit 0
fi
export LIBDDP_DIR=$libdir CARGO_TARGET_DIR=$target
log=$target/rust-suite.log; mkdir -p "$target"; : > "$log"
fail=0
cargo test --offline -q --no-run >>"$log" 2>&1 || { cat "$log"; echo "rust: 0 passed, 1 failed, 0 skipped"; exit 1; }
timeout 120 cargo test --offline -q 2>&1 | tee -a "$log" | grep -E "^test |panicked|FAILED|error" ; [ "${PIPESTATUS[0]}" -eq 0 ] || fail=1
skipped=0
if [ -n "$mpirun" ] && command -v "${mpirun%% *}" >/dev/null 2>&1; then
  for np in 2 3; do
    echo "--- mpirun -np $np cargo test --offline --test mpi"
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 $mpirun --oversubscribe -np $np \
      cargo test --offline -q --test mpi -- --nocapture 2>&1 | tee -a "$log" | grep -E "rust mpi ok|panicked|FAILED"
    [ "${PIPESTATUS[0]}" -eq 0 ] || fail=1
  done
  echo "--- mpirun -np 2 the docs example (examples/allreduce.rs)"
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 60 $mpirun --oversubscribe -np 2 \
    "$target/debug/examples/allreduce" > "$target/example.log" 2>&1
  if [ $? -eq 0 ] && [ "$(grep -c ': ok$' "$target/example.log")" -eq 2 ]; then
    echo "test result: ok. 1 passed; 0 failed (docs example)" | tee -a "$log"
  else
    cat "$target/example.log"; echo "test result: FAILED. 0 passed; 1 failed (docs example)" | tee -a "$log"
  fi
else
  echo "rust: mpirun not found: multi-rank runs skipped"; skipped=1
fi
# The same test over Gloo, started without mpirun (tools/ddp_launch sets what torchrun sets).
launch=../../tools/ddp_launch
if [ "${HAVE_GLOO:-0}" = 1 ] && [ -x "$launch" ]; then
  bin=$(ls -t "$target"/debug/deps/mpi-* 2>/dev/null | grep -v '\.d$' | head -n 1)
  echo "--- tools/ddp_launch -n 2, Comm::gloo(\"env://\"): the mpi test without mpirun"
  LIBDDP_TEST_GLOO=env:// MASTER_ADDR=127.0.0.1 timeout 120 "$launch" -n 2 "$bin" --nocapture 2>&1 | tee -a "$log" |
    grep -E -A2 "rust mpi ok|panicked|FAILED"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail=1
fi
passed=$(grep -oE "test result: [a-zA-Z]+\. [0-9]+ passed" "$log" | grep -oE "[0-9]+ passed" | awk '{s+=$1} END {print s+0}')
failed=$(grep -oE "; [0-9]+ failed" "$log" | grep -oE "[0-9]+" | awk '{s+=$1} END {print s+0}')
[ "$fail" -eq 1 ] && [ "$failed" -eq 0 ] && failed=1
echo "rust: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
