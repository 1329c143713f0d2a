# A one-machine Slurm cluster for the launchers suite, sourced by tests/launchers/run.sh: munged,
# slurmctld and slurmd run as children of the calling shell (in the foreground: -F, -D; each in a
# session of its own, so that a Ctrl-C meant for the suite reaches them only through slurm_stop), with every
# file of theirs (munge key and socket, slurm.conf, state, spool, logs) in one directory and ports
# found free, so that two clusters on one machine do not meet. Needs root and Debian's slurm-wlm and
# munge.
#   slurm_unavailable            prints why the cluster cannot start here (nothing when it can)
#   slurm_start DIR              starts it (SLURM_CONF is exported); fails naming the daemon and its log
#   slurm_stop                   cancels its jobs, stops the daemons (TERM, then KILL after 10 s) and
#                                waits for them; safe to call twice, and when slurm_start failed midway
#   slurm_leftovers              prints what of it is still running (nothing when it is all gone)
SLURM_DIR= MUNGED_PID= SLURMCTLD_PID= SLURMD_PID= SLURM_HELPERS=

slurm_unavailable() {
  if [ "$(id -u)" != 0 ]; then
    echo "not root (slurmd starts each job as its user; run make launchers as root)"
    return
  fi
  local c
  for c in munged mungekey munge slurmctld slurmd srun sbatch squeue scancel sinfo; do
    command -v "$c" >/dev/null 2>&1 ||
      { echo "no $c: install Debian's slurm-wlm and munge (tools/packages.txt; make setup as root)"; return; }
  done
}

slurm_free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

slurm_write_conf() {  # the node is this host, with its CPUs; jobs run as root, no cgroups, no accounting
  local host=$1
  cat >"$SLURM_DIR/slurm.conf" <<EOF
ClusterName=libddp
SlurmctldHost=$host
SlurmctldPort=$(slurm_free_port)
SlurmdPort=$(slurm_free_port)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SLURM_DIR/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
InactiveLimit=0
KillWait=5
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

# Waits up to $2 seconds for the command $1 to succeed.
slurm_wait_for() {
  local i
  for ((i = 0; i < $2 * 10; i++)); do
    eval "$1" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  return 1
}

slurm_start() {
  SLURM_DIR=$1
  local host
  host=$(hostname -s)
  mkdir -p "$SLURM_DIR"/{munge,state,spool,log} && chmod 700 "$SLURM_DIR" "$SLURM_DIR/munge" || return 1
  mungekey -c -k "$SLURM_DIR/munge/munge.key" || { echo "slurm: mungekey failed"; return 1; }
  setsid munged -F --force --socket="$SLURM_DIR/munge/munge.socket" --key-file="$SLURM_DIR/munge/munge.key" \
    --log-file="$SLURM_DIR/log/munged.log" --pid-file="$SLURM_DIR/munge/munged.pid" \
    --seed-file="$SLURM_DIR/munge/munged.seed" >"$SLURM_DIR/log/munged.out" 2>&1 &
  MUNGED_PID=$!
  if ! slurm_wait_for "munge -n -S '$SLURM_DIR/munge/munge.socket'" 10; then
    echo "slurm: munged did not start: $(tail -n 3 "$SLURM_DIR/log/munged.out" | tr '\n' ' ')"
    return 1
  fi
  slurm_write_conf "$host"
  export SLURM_CONF=$SLURM_DIR/slurm.conf
  setsid slurmctld -D -f "$SLURM_CONF" >"$SLURM_DIR/log/slurmctld.out" 2>&1 &
  SLURMCTLD_PID=$!
  setsid slurmd -D -f "$SLURM_CONF" -N "$host" >"$SLURM_DIR/log/slurmd.out" 2>&1 &
  SLURMD_PID=$!
  if ! slurm_wait_for "sinfo -h -o %T | grep -qx idle" 30; then
    echo "slurm: the node did not come up idle within 30 s (sinfo: $(sinfo -h -o '%T %E' 2>&1 | head -n 1));" \
      "slurmctld: $(tail -n 2 "$SLURM_DIR/log/slurmctld.out" | tr '\n' ' ') slurmd: $(tail -n 2 "$SLURM_DIR/log/slurmd.out" | tr '\n' ' ')"
    return 1
  fi
}

# The sockets slurmd keeps in its spool for each running job step.
slurm_steps() { [ -n "$SLURM_DIR" ] && find "$SLURM_DIR/spool" -maxdepth 1 -type s -name '*_*.*' 2>/dev/null; }

slurm_stop() {
  [ -n "$SLURM_DIR" ] || return 0
  if [ -n "$SLURMCTLD_PID" ] && kill -0 "$SLURMCTLD_PID" 2>/dev/null; then
    scancel --full --quiet --user=root 2>/dev/null
    slurm_wait_for '[ -z "$(squeue -h 2>/dev/null)" ] && [ -z "$(slurm_steps)" ]' 15
  fi
  local pid i
  # slurmctld's own helper (slurmscriptd) ends with it; kept to check that it did.
  [ -n "$SLURMCTLD_PID" ] && SLURM_HELPERS=$(pgrep -P "$SLURMCTLD_PID" 2>/dev/null | tr '\n' ' ')
  for pid in $SLURMD_PID $SLURMCTLD_PID $MUNGED_PID; do kill -TERM "$pid" 2>/dev/null; done
  for ((i = 0; i < 100; i++)); do
    local alive=0
    for pid in $SLURMD_PID $SLURMCTLD_PID $MUNGED_PID; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for pid in $SLURMD_PID $SLURMCTLD_PID $MUNGED_PID; do kill -KILL "$pid" 2>/dev/null; done
  for pid in $SLURMD_PID $SLURMCTLD_PID $MUNGED_PID; do wait "$pid" 2>/dev/null; done
  SLURMD_PID= SLURMCTLD_PID= MUNGED_PID=
}

slurm_leftovers() {
  [ -n "$SLURM_DIR" ] || return 0
  pgrep -a -f -- "$SLURM_DIR" 2>/dev/null
  local pid
  for pid in $SLURM_HELPERS; do kill -0 "$pid" 2>/dev/null && ps -o pid=,args= -p "$pid"; done
  slurm_steps
}
