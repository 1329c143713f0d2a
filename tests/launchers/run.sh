#!/usr/bin/env bash
# The launchers suite (make launchers): the example trainer over Gloo with --init auto, started by the
# launchers clusters use, each run's losses against the same run started by tools/ddp_launch:
#   Slurm     a one-machine cluster started here (tests/launchers/slurm_cluster.sh): srun -n 2 and
#             srun -n 4; a contradiction (RANK=1 exported into srun's tasks) and a trainer started in
#             a batch script without srun, both refused by name. Skipped, saying why, without root or
#             without slurm-wlm and munge. The daemons are stopped on every exit (a trap) and checked gone.
#   Open MPI  mpirun -np 3 of a trainer built without MPI (Gloo only).
# Prints "launchers: P passed, F failed, S skipped".
# Usage: run.sh BUILD_DIR TRAINER NOMPI_TRAINER
build=$1 trainer=$2 nompi_trainer=$3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# What the shell that runs the suite may carry from a launcher of its own must not reach the ranks.
for v in $(env | sed -n 's/^\(RANK\|WORLD_SIZE\|LOCAL_[A-Z_]*\|MASTER_[A-Z]*\|GROUP_RANK\|TORCHELASTIC_[A-Z_]*\|OMPI_COMM_WORLD_[A-Z_]*\|PMIX\?_[A-Z_]*\|MPI_LOCAL[A-Z]*\|SLURM_[A-Z_]*\|DDP_STORE_PORT\|DDP_JOB_ID\)=.*/\1/p'); do
  unset "$v"
done
tp=0 tf=0 ts=0
check() {  # name, ok (0/1), detail
  if [ "$2" = 1 ]; then tp=$((tp + 1)); echo "  ok   $1"; else tf=$((tf + 1)); echo "  FAIL $1: $3"; fi
}
skip() { ts=$((ts + 1)); echo "  skip $1"; }
# Runs a command in the background and waits for it: a signal to this script is then acted on at once
# (bash runs a trap only once the foreground command is done; `wait` it interrupts). Its output goes
# to $run_out, its exit status is returned.
RUN_PID= run_out=$(mktemp)
run() {
  "$@" >"$run_out" 2>&1 &
  RUN_PID=$!
  wait "$RUN_PID"
}

args=(--steps 8 --batch 32 --quiet)
losses() { grep -E '^(step .* loss|loss .* ->|ranks agree)' <<<"$1" | sed -E 's/ +\([0-9.]+ ms\)//'; }
# The reference: the same training started by tools/ddp_launch (torchrun's variables, env://).
reference() {  # np, trainer: the losses into $ref
  run timeout 300 "$root/tools/ddp_launch" -n "$1" "$2" --comm gloo "${args[@]}"
  ref=$(losses "$(cat "$run_out")")
}
# A run over auto: exit 0, every rank's log line naming the launcher and its rank, the ranks agreeing,
# and the losses of the reference.
check_run() {  # name, launcher, np, output, exit status, reference
  local name=$1 launcher=$2 np=$3 out=$4 rc=$5 ref=$6 ok=1 r
  [ "$rc" -eq 0 ] || ok=0
  grep -q "^mlp_trainer: $np ranks over gloo" <<<"$out" || ok=0
  grep -q "^ranks agree: losses and parameters identical on all $np ranks" <<<"$out" || ok=0
  for ((r = 0; r < np; r++)); do
    grep -q "init method auto: launcher $launcher; rank $r (.*) of $np " <<<"$out" || ok=0
  done
  [ -n "$ref" ] && [ "$(losses "$out")" = "$ref" ] || ok=0
  check "$name: $(grep -E '^loss' <<<"$out")" $ok \
    "exit $rc; $(grep -m 2 'init method auto' <<<"$out"); $(tail -n 4 <<<"$out")"
  [ $ok = 1 ] && grep -m 1 "init method auto: launcher $launcher; rank 1 " <<<"$out" | sed 's/^/       /'
}

# --- Slurm -------------------------------------------------------------------------------------
slurm_part() {
  # shellcheck source=tests/launchers/slurm_cluster.sh
  . "$here/slurm_cluster.sh"
  local why
  why=$(slurm_unavailable)
  if [ -n "$why" ]; then
    skip "Slurm: $why"
    return
  fi
  local dir
  dir=$(mktemp -d "$(cd "$build" && pwd)/slurm.XXXXXX")
  trap 'kill "$RUN_PID" 2>/dev/null; slurm_stop; echo "launchers: interrupted; the Slurm daemons stopped"; exit 130' INT TERM
  trap 'slurm_stop' EXIT
  if ! slurm_start "$dir" >"$dir/start.log" 2>&1; then
    check "Slurm: a one-machine cluster (munged, slurmctld, slurmd) starts" 0 "$(tail -n 3 "$dir/start.log")"
  else
    echo "  Slurm: one node ($(hostname -s), $(nproc) CPUs) in $dir"
    # More tasks than CPUs (--overcommit), a failed rank ends the step, one Ctrl-C ends srun.
    local np out rc srun_opts="--overcommit --kill-on-bad-exit=1 --quit-on-interrupt"
    for np in 2 4; do
      DDP_DEBUG=INFO run timeout 300 srun $srun_opts -n "$np" "$trainer" --comm gloo --init auto "${args[@]}"
      rc=$? out=$(cat "$run_out")
      reference "$np" "$trainer"
      check_run "srun -n $np, --init auto" Slurm "$np" "$out" "$rc" "$ref"
    done
    RANK=1 run timeout 120 srun $srun_opts -n 2 "$trainer" --comm gloo --init auto "${args[@]}"
    rc=$? out=$(cat "$run_out")
    ok=0; [ $rc -ne 0 ] && grep -q "RANK=1 (torchrun) but SLURM_PROCID=0 (Slurm)" <<<"$out" && ok=1
    check "srun -n 2 with RANK=1 exported: refused, naming RANK=1 and SLURM_PROCID=0" $ok "exit $rc; $(tail -n 3 <<<"$out")"
    run timeout 120 sbatch --overcommit -n 2 -W -o "$dir/batch.out" --wrap "$trainer --comm gloo --init auto ${args[*]}"
    rc=$? out=$(cat "$run_out")
    ok=0; [ $rc -ne 0 ] && grep -q "SLURM_STEP_ID is not: this is a Slurm batch script" "$dir/batch.out" && ok=1
    check "a trainer started in a batch script without srun: refused, saying to use srun" $ok \
      "exit $rc; $out; $(tail -n 3 "$dir/batch.out" 2>/dev/null)"
  fi
  slurm_stop
  trap - INT TERM EXIT
  local left
  left=$(slurm_leftovers)
  ok=0; [ -z "$left" ] && ok=1
  check "Slurm: the daemons are stopped and gone (pgrep finds none of this cluster's)" $ok "still running: $left"
  [ $ok = 1 ] && rm -rf "$dir"
}

# --- Open MPI's mpirun, the trainer built without MPI --------------------------------------------
mpirun_part() {
  if ! command -v "$MPIRUN" >/dev/null 2>&1; then
    skip "mpirun -np 3: no $MPIRUN (install openmpi-bin)"
    return
  fi
  if ldd "$nompi_trainer" 2>/dev/null | grep -q libmpi; then
    check "the trainer built with MPI=0 links no MPI" 0 "$(ldd "$nompi_trainer" | grep libmpi)"
    return
  fi
  local out rc
  args=(--steps 12 --batch 32 --quiet)  # at 3 ranks the loss rises over the first 8 steps (the trainer fails then)
  run timeout 300 "$MPIRUN" --oversubscribe --bind-to none -x DDP_DEBUG=INFO -np 3 "$nompi_trainer" --comm gloo \
    --init auto "${args[@]}"
  rc=$? out=$(cat "$run_out")
  reference 3 "$nompi_trainer"
  check_run "mpirun -np 3 (Open MPI) of a trainer built without MPI, --init auto" "Open MPI" 3 "$out" "$rc" "$ref"
}

echo "== launchers: the example trainer over Gloo with --init auto, started by Slurm's srun and Open MPI's mpirun"
slurm_part
mpirun_part
rm -f "$run_out"
echo "launchers: $tp passed, $tf failed, $ts skipped"
[ "$tf" -eq 0 ]
