#!/usr/bin/env bash
# Runs every fault scenario of the faults binary under mpirun, each under a wall-clock bound, and
# sums them into "faults: N passed, N failed". A scenario passes when every RESULT line says ok, the
# expected ranks print DONE, and it ends within its bound. Usage: run.sh BIN [gloo]
# The exit-* scenarios run EXIT_REPEAT times each (default 10) under a wrapper that prints each
# rank's exit status: a rank that crashes at exit (a signal, a sanitizer's abort) fails the run, and
# exit-no-destroy wants every rank to exit with 0. SCENARIOS="a b" runs only those (make exit-soak).
# With "gloo" the scenarios that touch the communicator run over Gloo (each on a fresh tcp:// port;
# mpirun only starts the ranks) and the summary says "faults-gloo".
bin=$1
over=${2:-mpi}
label=faults; [ "$over" = gloo ] && label=faults-gloo
MPIRUN=${MPIRUN:-mpirun}
T=${TIMEOUT_MS:-2000}
seed=${DDP_TEST_SEED:-$(date +%s)}
pass=0; fail=0
# scenario  ranks  ranks that must finish  bound (s)  mpirun flags
scenarios=(
  "die-exit  3 2 $((T / 1000 + 20)) --enable-recovery"
  "die-kill  3 2 $((T / 1000 + 20)) --enable-recovery"
  "stall     3 3 $((2 * T / 1000 + 25)) --enable-recovery"
  "mismatch  3 3 60 "
  "unused    3 3 60 "
  "nonfinite 2 2 60 "
  "threads   2 2 90 "
  "blocked   2 1 $((T / 1000 + 20)) --enable-recovery"
  "inspect-kill  3 2 $((T / 1000 + 20)) --enable-recovery"
  "inspect-kill  4 3 $((T / 1000 + 20)) --enable-recovery"
  "inspect-stall 3 2 $((2 * T / 1000 + 25)) --enable-recovery"
  "inspect-stall 4 3 $((2 * T / 1000 + 25)) --enable-recovery"
  "inspect-skip  3 3 $((2 * T / 1000 + 25)) --enable-recovery"
  "inspect-skip  4 4 $((2 * T / 1000 + 25)) --enable-recovery"
  "inspect-destroy 3 3 $((2 * T / 1000 + 25)) --enable-recovery"
  "inspect-slow  3 3 $((2 * T / 1000 + 25)) "
  "inspect-slow  4 4 $((2 * T / 1000 + 25)) "
  "shard-kill   3 2 $((T / 1000 + 20)) --enable-recovery"
  "shard-stall  3 3 $((2 * T / 1000 + 25)) --enable-recovery"
  "gather-kill  3 2 $((T / 1000 + 20)) --enable-recovery"
  "gather-stall 4 3 $((2 * T / 1000 + 25)) --enable-recovery"
  "join-kill    3 2 $((T / 1000 + 20)) --enable-recovery"
  "join-kill    4 3 $((T / 1000 + 20)) --enable-recovery"
  "create-late  3 3 $((T / 1000 + 20)) "
  "gloo-init-die 3 2 $((T / 1000 + 20)) --enable-recovery"
  "exit-no-destroy 3 3 60 "
  "exit-timeout 3 2 $((T / 1000 + 20)) --enable-recovery"
)
EXIT_REPEAT=${EXIT_REPEAT:-10}
# Exit statuses of a crash: 128 + SIGILL, SIGABRT (sanitizers abort), SIGBUS, SIGFPE, SIGSEGV.
crash_status='^EXIT rank [0-9]+ status (132|134|135|136|139)$'
exit_wrap='"$0" "$@"; echo "EXIT rank ${OMPI_COMM_WORLD_RANK:-?} status $?"'

# Over Gloo: one of each kind of fault (the local-group ones, nonfinite and unused, say nothing new).
gloo_scenarios=" die-exit die-kill stall mismatch threads blocked inspect-kill inspect-stall inspect-skip inspect-destroy
  shard-kill gather-stall join-kill create-late gloo-init-die exit-no-destroy exit-timeout "
gloo_only=" gloo-init-die "
gloo_scenarios=" $(echo $gloo_scenarios) "
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null ||
  echo $((20000 + RANDOM % 30000)); }
runs=()
for line in "${scenarios[@]}"; do
  read -r name np _ <<<"$line"
  if [ -n "$SCENARIOS" ] && [[ " $SCENARIOS " != *" $name "* ]]; then continue; fi
  [ "$over" != gloo ] && [[ "$gloo_only" == *" $name "* ]] && continue
  n=1; [[ $name == exit-* ]] && n=$EXIT_REPEAT
  for ((i = 0; i < n; i++)); do runs+=("$line"); done
done
exits=0; exit_crashes=0
for line in "${runs[@]}"; do
  read -r name np want bound flags <<<"$line"
  if [ "$over" = gloo ]; then
    [[ "$gloo_scenarios" == *" $name "* ]] || continue
    export DDP_TEST_GLOO="tcp://127.0.0.1:$(free_port)"
    flags="$flags -x DDP_TEST_GLOO"
  fi
  # Where the survivors meet before they leave (leave_with in faults.cpp).
  DDP_TEST_RUN_DIR=$(mktemp -d) && export DDP_TEST_RUN_DIR
  t0=$(date +%s%N)
  if [[ $name == exit-* ]]; then
    out=$(timeout -k 5 "$bound" $MPIRUN --oversubscribe $flags -x DDP_TEST_RUN_DIR -np "$np" \
      bash -c "$exit_wrap" "$bin" "$name" "$seed" "$T" 2>&1)
  else
    out=$(timeout -k 5 "$bound" $MPIRUN --oversubscribe $flags -x DDP_TEST_RUN_DIR -np "$np" "$bin" "$name" "$seed" "$T" 2>&1)
  fi
  rc=$?
  rm -rf "$DDP_TEST_RUN_DIR"
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  results=$(grep -E '^RESULT ' <<<"$out")
  bad=$(grep -cE '^RESULT [^ ]+ FAIL' <<<"$out")
  good=$(grep -cE '^RESULT [^ ]+ ok' <<<"$out")
  done_n=$(grep -cE '^DONE rank' <<<"$out")
  why=""
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="ran past its bound of ${bound}s"
  [ -z "$why" ] && [ "$bad" -gt 0 ] && why="$bad checks failed"
  [ -z "$why" ] && [ "$good" -eq 0 ] && why="no checks ran"
  [ -z "$why" ] && [ "$done_n" -lt "$want" ] && why="only $done_n of $want ranks finished"
  if [[ $name == exit-* ]]; then
    exits=$((exits + 1))
    clean=$(grep -cE '^EXIT rank [0-9]+ status 0$' <<<"$out")
    if grep -qE "$crash_status" <<<"$out"; then
      exit_crashes=$((exit_crashes + 1))
      [ -z "$why" ] && why="a rank crashed at exit: $(grep -E "$crash_status" <<<"$out" | tr '\n' ' ')"
    fi
    [ -z "$why" ] && [ "$clean" -lt "$want" ] && why="only $clean of $want ranks exited with status 0"
  fi
  # Sanitizer reports fail a scenario even when its checks passed.
  if [ -z "$why" ] && grep -qE 'ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:|WARNING: ThreadSanitizer' <<<"$out"; then
    why="sanitizer report"
  fi
  sed 's/^/  /' <<<"$results"
  if [ -z "$why" ]; then
    echo "$label: $name (np=$np) passed: $good checks, ${ms} ms (bound ${bound}s)"
    pass=$((pass + 1))
  else
    echo "$label: $name (np=$np) FAILED: $why (exit $rc, ${ms} ms); last output:"
    grep -vE '^RESULT ' <<<"$out" | tail -n 25 | sed 's/^/    /'
    fail=$((fail + 1))
  fi
done
[ "$exits" -gt 0 ] && echo "$label: exit scenarios: $exits runs, $exit_crashes with a crash at exit"
echo "$label: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
