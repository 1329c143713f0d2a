#!/usr/bin/env bash
# The Gloo suite: the communicator under the multi-rank tests and the fault scenarios (mpirun only
# starts the ranks, every collective goes over Gloo), and the example trainer started without mpirun
# by tools/ddp_launch, meeting over env:// and over a file store, whose losses must equal the MPI
# run's. Prints "gloo: P passed, F failed".
# Usage: run.sh BUILD_DIR TRAINER|none [MPI_REDUCE MPI_SHARD FAULTS]  (the last three need MPI)
build=$1 trainer=$2 reduce_bin=${3:-} shard_bin=${4:-} faults_bin=${5:-}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
tp=0 tf=0
add() {  # the last "label: P passed, F failed" line of $1
  local line
  line=$(grep -E '^[A-Za-z0-9_-]+: [0-9]+ passed, [0-9]+ failed' <<<"$1" | tail -n 1)
  if [ -z "$line" ]; then echo "gloo: $2 printed no summary"; tf=$((tf + 1)); return; fi
  tp=$((tp + $(sed -E 's/.*: ([0-9]+) passed.*/\1/' <<<"$line"))); tf=$((tf + $(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"$line")))
}
check() {  # name, ok (0/1), detail
  if [ "$2" = 1 ]; then tp=$((tp + 1)); echo "  ok   $1"; else tf=$((tf + 1)); echo "  FAIL $1: $3"; fi
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

if [ -n "$reduce_bin" ]; then
  export DDP_TEST_GLOO="tcp://127.0.0.1:$(free_port)"
  out=$(MPIRUN="$MPIRUN -x DDP_TEST_GLOO" "$root/tests/mpi/run.sh" "$reduce_bin" gloo 2>&1)
  echo "$out" | grep -E '^gloo' | tail -n 5; add "$out" gloo
  export DDP_TEST_GLOO="tcp://127.0.0.1:$(free_port)"
  out=$(MPIRUN="$MPIRUN -x DDP_TEST_GLOO" "$root/tests/mpi/run.sh" "$shard_bin" gloo-shard 2>&1)
  echo "$out" | grep -E '^gloo-shard' | tail -n 5; add "$out" gloo-shard
  unset DDP_TEST_GLOO
  out=$(MPIRUN="$MPIRUN" "$root/tests/faults/run.sh" "$faults_bin" gloo 2>&1)
  # Every scenario's line (a failure's output and failed checks too), without the RESULT lines that passed.
  echo "$out" | grep -vE '^  RESULT [^ ]+ ok' | grep -vE '\) passed: ' ; add "$out" faults-gloo
fi

if [ "$trainer" = none ]; then  # a sanitized build: no trainer
  echo "gloo: $tp passed, $tf failed"
  [ "$tf" -eq 0 ]
  exit
fi

# The trainer without mpirun. Its printed losses (6 decimals), accuracy and agreement line must be
# those of the same run over MPI (or, without MPI, of the other Gloo runs).
args=(--steps 8 --batch 32 --quiet)
losses() { grep -E '^(step .* loss|loss .* ->|ranks agree)' <<<"$1" | sed -E 's/ +\([0-9.]+ ms\)//'; }
for np in 2 4; do
  ref=
  if [ -n "$reduce_bin" ]; then
    ref=$(timeout 300 $MPIRUN --oversubscribe -np "$np" "$trainer" "${args[@]}" 2>&1)
    ref=$(losses "$ref")
  fi
  out=$(timeout 300 "$root/tools/ddp_launch" -n "$np" "$trainer" --comm gloo "${args[@]}" 2>&1); rc=$?
  got=$(losses "$out")
  [ -z "$ref" ] && ref=$got
  [ "$np" = 2 ] && demo_ref=$ref
  ok=0; [ $rc -eq 0 ] && grep -q "^mlp_trainer: $np ranks over gloo" <<<"$out" && [ -n "$got" ] && [ "$got" = "$ref" ] && ok=1
  check "trainer, $np processes over env:// (ddp_launch, no mpirun): $(grep -E '^loss' <<<"$got")" $ok "exit $rc; $(tail -n 5 <<<"$out")"
  if [ "$np" = 2 ]; then
    dir=$(mktemp -d "$build/gloo-store.XXXXXX")
    out=$(timeout 300 "$root/tools/ddp_launch" -n 2 "$trainer" --comm gloo --init "file://$dir" "${args[@]}" 2>&1); rc=$?
    left=$(ls -A "$dir" | wc -l); rm -rf "$dir"
    ok=0; [ $rc -eq 0 ] && [ "$(losses "$out")" = "$ref" ] && [ "$left" -eq 0 ] && ok=1
    check "trainer, 2 processes over a file store, the directory left empty" $ok "exit $rc, $left files left; $(tail -n 5 <<<"$out")"
  fi
done

# An elastic run: 3 processes started by ddp_launch --elastic (the store in ddp_store), rank 0 killed
# before step 3's backward: the other two recover, take the most advanced state, and finish; the
# launcher reports the death and exits 0.
out=$(timeout 300 "$root/tools/ddp_launch" --elastic -n 3 "$trainer" --comm gloo --elastic --kill 0@2 \
      --steps 8 --batch 32 --quiet 2>&1); rc=$?
ok=0; [ $rc -eq 0 ] && grep -q "rank 0 was killed by signal 9; the other ranks go on" <<<"$out" &&
  grep -q "^membership 1: 2 ranks now (3 before)" <<<"$out" && grep -q "^ranks agree: .* on all 2 ranks" <<<"$out" &&
  ! grep -q "the loss did not fall" <<<"$out" && ok=1
check "trainer --elastic over ddp_launch --elastic: rank 0 killed at step 3, the other two go on and agree" $ok \
  "exit $rc; $(tail -n 8 <<<"$out")"

# A replacement: ddp_launch --max-restarts 1 starts a process with DDP_JOIN=1 in place of rank 1,
# killed before step 4's backward; the trainer joins through ddp_comm_join_gloo, the others admit it
# at a step boundary, and all three finish with identical losses and parameters.
out=$(timeout 300 "$root/tools/ddp_launch" --max-restarts 1 -n 3 "$trainer" --comm gloo --elastic --kill 1@3 \
      --steps 12 --batch 32 --quiet 2>&1); rc=$?
ok=0; [ $rc -eq 0 ] && grep -q "rank 1 was killed by signal 9; starting a process that joins the running job" <<<"$out" &&
  grep -q "^membership 1: 2 ranks now (3 before)" <<<"$out" && grep -q "^membership 2: 3 ranks now (2 before)" <<<"$out" &&
  grep -q "^ranks agree: .* on all 3 ranks" <<<"$out" && ! grep -q "the loss did not fall" <<<"$out" && ok=1
check "trainer --elastic over ddp_launch --max-restarts 1: rank 1 killed at step 4, its replacement joins, all 3 agree" \
  $ok "exit $rc; $(tail -n 8 <<<"$out")"

# The job ends before admitting the replacement (rank 1 killed before the last step's backward): the end
# reaches the waiting replacement at once (DDP_ERR_ABORTED, "ended before admitting"), which exits 0, and
# the launcher returns in seconds, not after the replacement's 300 s join bound.
t0=$(date +%s%N)
out=$(timeout 120 "$root/tools/ddp_launch" --max-restarts 1 -n 3 "$trainer" --comm gloo --elastic --kill 1@7 \
      --steps 8 --batch 32 --quiet 2>&1); rc=$?
ms=$((($(date +%s%N) - t0) / 1000000))
ok=0; [ $rc -eq 0 ] && grep -q "starting a process that joins the running job" <<<"$out" &&
  grep -q "^joiner: ddp_recover: the job at env:// (.*) ended before admitting this process" <<<"$out" &&
  grep -q "^ranks agree: .* on all 2 ranks" <<<"$out" && [ $ms -lt 60000 ] && ok=1
check "ddp_launch --max-restarts: the job ends before admitting the replacement, which hears so at once (${ms} ms)" \
  $ok "exit $rc; $(tail -n 5 <<<"$out")"

# make demo over Gloo (what it runs without MPI): 2 ranks, the same losses.
out=$(timeout 300 make --no-print-directory BUILD="$build" DEMO_COMM=gloo DEMO_ARGS="${args[*]}" demo 2>&1); rc=$?
ok=0; [ $rc -eq 0 ] && grep -q "^mlp_trainer: 2 ranks over gloo" <<<"$out" && [ "$(losses "$out")" = "$demo_ref" ] && ok=1
check "make demo DEMO_COMM=gloo: 2 ranks started by tools/ddp_launch" $ok "exit $rc; $(tail -n 5 <<<"$out")"

# The launcher's environment and its refusals.
out=$("$root/tools/ddp_launch" -n 2 --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port 29999 \
      bash -c 'echo "env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT"' 2>&1 | sort)
want=$(printf 'env 2 0 4 2 1 127.0.0.1 29999\nenv 3 1 4 2 1 127.0.0.1 29999')
ok=0; [ "$out" = "$want" ] && ok=1
check "ddp_launch: node 1 of 2 runs ranks 2 and 3 with torchrun's variables" $ok "got '$out'"
# A replacement (--max-restarts) has no rank until the job admits it: neither RANK nor WORLD_SIZE (not
# even the launcher's own), but DDP_JOIN=1, DDP_RESTART and DDP_REPLACES (whose place it takes).
out=$(RANK=7 WORLD_SIZE=9 "$root/tools/ddp_launch" -n 2 --max-restarts 1 bash -c \
  'if [ -z "${DDP_JOIN:-}" ]; then [ "$RANK" = 1 ] && exit 3; exit 0; fi
   echo "replacement RANK=${RANK-unset} WORLD_SIZE=${WORLD_SIZE-unset} DDP_RESTART=$DDP_RESTART DDP_REPLACES=$DDP_REPLACES LOCAL_RANK=$LOCAL_RANK"' 2>&1); rc=$?
ok=0; [ $rc -eq 0 ] && grep -qx "replacement RANK=unset WORLD_SIZE=unset DDP_RESTART=1 DDP_REPLACES=1 LOCAL_RANK=1" <<<"$out" && ok=1
check "ddp_launch --max-restarts: a replacement gets DDP_JOIN=1 and DDP_REPLACES=1, no RANK or WORLD_SIZE" $ok "exit $rc; $out"
# Its own ports lie below the kernel's range for outgoing connections (no connection takes them, and
# no rank reaches its own port while the store is not listening yet), both free.
low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
ports=$(for _ in 1 2 3 4 5; do env -u MASTER_PORT "$root/tools/ddp_launch" -n 1 bash -c 'echo "$MASTER_PORT"'; done)
ok=1; for p in $ports; do [ "$p" -ge 10000 ] && [ $((p + 1)) -lt "$low" ] || ok=0; done
[ "$(wc -w <<<"$ports")" -eq 5 ] || ok=0
check "ddp_launch: its MASTER_PORT and the store's port lie below ip_local_port_range ($low)" $ok "got '$(echo $ports)'"
for bad in "-n 0 true|need -n >= 1" "-n x true|nproc 'x' is not a number" "--nnodes 2 --node-rank 2 --master-port 1 true|--node-rank < --nnodes" \
           "|no program given" "--frobnicate true|unknown option '--frobnicate'"; do
  args_=${bad%%|*}; msg=${bad#*|}
  out=$("$root/tools/ddp_launch" $args_ 2>&1); rc=$?
  ok=0; [ $rc -eq 2 ] && grep -qF -- "$msg" <<<"$out" && ok=1
  check "ddp_launch $args_: refused (exit 2), naming it" $ok "exit $rc: $out"
done

# Two jobs on one port: job B (2 ranks, its rank 1 three seconds late) started by ddp_launch, and by
# hand a rank 1 of job A: the stray is refused by name at once, job B trains to the end, and while rank
# 1 is missing rank 0 says so on stderr (DDP_INIT_PROGRESS_MS, a warning: printed by default).
port=$(free_port)
outb=$(mktemp "$build/gloo-jobb.XXXXXX")
DDP_INIT_PROGRESS_MS=1000 timeout 120 "$root/tools/ddp_launch" -n 2 --master-port "$port" --job-id jobB \
  bash -c '[ "$RANK" = 1 ] && sleep 3; exec "$@"' _ "$trainer" --comm gloo "${args[@]}" >"$outb" 2>&1 &
bpid=$!
sleep 1
t0=$(date +%s%N)
out=$(RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port DDP_JOB_ID=jobA DDP_INIT_TIMEOUT_MS=30000 \
      timeout 60 "$trainer" --comm gloo "${args[@]}" 2>&1); rc=$?
ms=$((($(date +%s%N) - t0) / 1000000))
ok=0; [ $rc -ne 0 ] && grep -q "DDP_ERR_MISMATCH\|ranks disagree" <<<"$out" && grep -q "rank 1 (job 'jobA', WORLD_SIZE=2" <<<"$out" &&
  grep -q "belongs to job 'jobB'" <<<"$out" && [ $ms -lt 10000 ] && ok=1
check "two jobs on one port: job A's stray rank 1 refused by name in ${ms} ms" $ok "exit $rc; $(tail -n 3 <<<"$out")"
wait $bpid; rc=$?
outb_text=$(cat "$outb"); rm -f "$outb"
ok=0; [ $rc -eq 0 ] && grep -q "^mlp_trainer: 2 ranks over gloo" <<<"$outb_text" &&
  grep -q "a rank of another job was turned away: rank 1 (job 'jobA'" <<<"$outb_text" && ok=1
check "two jobs on one port: job B warned of the stray and trained to the end" $ok "exit $rc; $(tail -n 5 <<<"$outb_text")"
ok=0; grep -qE "^libddp warning: waiting for ranks at env:// \(127\.0\.0\.1:$((port + 1))\): 1 of 2 arrived; missing rank 1 \(waited [0-9.]+ s of 300 s\)" <<<"$outb_text" && ok=1
check "the progress line on stderr while rank 1 is missing" $ok "$(grep -m3 'libddp' <<<"$outb_text")"

# A rank that dies: the launcher stops the others at once and exits with the dead rank's status.
t0=$(date +%s%N)
out=$(timeout 120 "$root/tools/ddp_launch" -n 3 bash -c '[ "$RANK" = 2 ] && kill -9 $$; exec "$@"' _ "$trainer" \
        --comm gloo --steps 200 --quiet 2>&1); rc=$?
ms=$((($(date +%s%N) - t0) / 1000000))
ok=0; [ $rc -eq 137 ] && grep -q "rank 2 exited with status 137" <<<"$out" && [ $ms -lt 60000 ] && ok=1
check "ddp_launch: rank 2 killed, the job ends with its status 137 in ${ms} ms" $ok "exit $rc; $(tail -n 5 <<<"$out")"

echo "gloo: $tp passed, $tf failed"
[ "$tf" -eq 0 ]
