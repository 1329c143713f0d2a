#!/usr/bin/env bash
# make bench-network (and make bench's section 8): the compressed wires over an emulated network.
# Two emulated hosts: network namespaces ddp-net-h0 and ddp-net-h1, joined by a veth pair (ddpnet0 in
# h0 at 10.231.0.1/24, ddpnet1 in h1 at 10.231.0.2/24: addresses that exist only inside these two
# namespaces), both ends shaped with tc's token bucket filter to each rate of NET_RATES. For every
# rate, the example trainer runs over Gloo's TCP with rank 0 in h0 and rank 1 in h1, with every wire
# (none, bf16, fp16, int8), NET_RUNS times each, the wires interleaved within a round; a table per
# rate gives the median step time, the median exposed communication per step and the step time over
# the fp32 wire's. Raw numbers: OUTDIR/network.json.
#
#   bench/netns_wires.sh [TRAINER [OUTDIR]]
#
# TRAINER: the example trainer (default $BUILD/examples/mlp_trainer, BUILD defaulting to build);
# OUTDIR: where network.json goes (default $BUILD/bench). Knobs (environment): NET_RATES ("1gbit 10gbit",
# tc's rate syntax), NET_STEPS (trainer steps per run, 16), NET_RUNS (3), NET_WIRES ("none bf16 fp16
# int8"), NET_TIMEOUT (seconds per trainer run, 120), NET_PORT (the first MASTER_PORT, 29400).
# Needs root, ip and tc (iproute2) and network namespaces; without them it says why and exits 0.
# The namespaces (and with them the veth pair) are deleted on exit, on failure and on Ctrl-C. Namespaces
# of these names left over by an earlier run are deleted first when no process runs in them; otherwise
# the script refuses to start.
set -u
BUILD=${BUILD:-build}
trainer=${1:-$BUILD/examples/mlp_trainer}
out=${2:-$BUILD/bench}
RATES=${NET_RATES:-1gbit 10gbit}
STEPS=${NET_STEPS:-16}
RUNS=${NET_RUNS:-3}
WIRES=${NET_WIRES:-none bf16 fp16 int8}
TMO=${NET_TIMEOUT:-120}
PORT=${NET_PORT:-29400}
NS0=ddp-net-h0 NS1=ddp-net-h1 IF0=ddpnet0 IF1=ddpnet1 ADDR0=10.231.0.1 ADDR1=10.231.0.2
say() { echo "network: $*"; }
skip() { say "skipped: $*"; exit 0; }

[ "$(id -u)" -eq 0 ] || skip "needs root (it makes network namespaces, a veth pair and tc qdiscs); run as root: make bench-network"
for t in ip tc timeout; do
  command -v "$t" >/dev/null 2>&1 || skip "'$t' not found (ip and tc: Debian's iproute2; timeout: coreutils)"
done
[ -x "$trainer" ] || { say "no trainer at '$trainer' (make examples, or give its path)"; exit 1; }
for n in $STEPS $RUNS $TMO $PORT; do
  [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] || { say "NET_STEPS, NET_RUNS, NET_TIMEOUT, NET_PORT must be positive integers"; exit 2; }
done
[ "$STEPS" -ge 3 ] || { say "NET_STEPS must be at least 3 (the first step is left out of the median)"; exit 2; }

# One run at a time: a second run would delete the first's namespaces.
lock=/run/lock/ddp-netns-wires.lock
[ -d /run/lock ] || lock=/tmp/ddp-netns-wires.lock
if command -v flock >/dev/null 2>&1; then
  exec 9>"$lock"
  flock -n 9 || { say "another run holds $lock; not starting"; exit 1; }
fi

pids=()
stop_ranks() {
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "${pids[@]}" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "${pids[@]}" 2>/dev/null
  wait "${pids[@]}" 2>/dev/null
  pids=()
}
made=0
teardown() {
  stop_ranks
  [ "$made" -eq 1 ] || return 0
  local ns
  for ns in $NS0 $NS1; do
    # Anything still running in the namespace (our ranks only) would keep it alive.
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
    ip netns delete "$ns" 2>/dev/null
  done
  made=0
  if ip netns list 2>/dev/null | grep -qE "^($NS0|$NS1)( |$)"; then
    say "could not delete the namespaces $NS0 $NS1: delete them with 'ip netns delete NAME'"
  fi
}
trap 'teardown' EXIT
trap 'say "interrupted; tearing down"; teardown; exit 130' INT TERM

# Left over from an earlier run that could not clean up (killed with SIGKILL, a crash)?
for ns in $NS0 $NS1; do
  ip netns list 2>/dev/null | grep -qE "^$ns( |$)" || continue
  if [ -n "$(ip netns pids "$ns" 2>/dev/null)" ]; then
    say "namespace $ns exists and has processes running in it (pids $(ip netns pids "$ns" | tr '\n' ' ')); not starting"
    exit 1
  fi
  ip netns delete "$ns" 2>/dev/null || { say "namespace $ns is left over and cannot be deleted; not starting"; exit 1; }
  say "deleted namespace $ns left over by an earlier run"
done

made=1
if ! ip netns add $NS0 2>/dev/null || ! ip netns add $NS1 2>/dev/null; then
  teardown
  skip "cannot make network namespaces here ('ip netns add' failed: no CAP_SYS_ADMIN, or no netns support)"
fi
# The veth pair is made inside h0 with its peer inside h1: no interface or address in any other namespace.
if ! { ip -n $NS0 link add $IF0 type veth peer name $IF1 netns $NS1 &&
       ip -n $NS0 addr add $ADDR0/24 dev $IF0 && ip -n $NS1 addr add $ADDR1/24 dev $IF1 &&
       ip -n $NS0 link set lo up && ip -n $NS1 link set lo up &&
       ip -n $NS0 link set $IF0 up && ip -n $NS1 link set $IF1 up; }; then
  teardown
  skip "cannot make the veth pair between the namespaces (no veth support?)"
fi

# Shaping, both ends (each direction of a full-duplex link gets the rate). burst: 1 ms of the rate
# (125 kB at 1 Gbit/s, 1.25 MB at 10 Gbit/s), at least 64 KiB so that a 64 KiB GSO segment passes whole:
# small against a step (tens to hundreds of ms), so the rate holds within about 1 ms a step, yet long
# enough that the link does not idle between the kernel's timer wake-ups on a loaded machine. latency
# 20 ms: the queue holds 20 ms of the rate (2.5 MB at 1 Gbit/s) on top of the burst, so TCP fills the
# link without a drop storm (the path's own round trip is tens of microseconds), while the bytes
# queued are only ever bytes the rate would take that long to send anyway.
rate_bits() { # tc's rate words to bits per second
  awk -v r="$1" 'BEGIN { n = r + 0; u = tolower(substr(r, length(n "") + 1));
    m = (u ~ /^g/) ? 1e9 : (u ~ /^m/) ? 1e6 : (u ~ /^k/) ? 1e3 : 1;
    if (u ~ /bps$/) m *= 8; printf "%.0f", n * m }'
}
shape() {
  local bits burst
  bits=$(rate_bits "$1")
  burst=$((bits / 8 / 1000)); [ "$burst" -ge 65536 ] || burst=65536
  tc -n $NS0 qdisc replace dev $IF0 root tbf rate "$1" burst "$burst" latency 20ms &&
    tc -n $NS1 qdisc replace dev $IF1 root tbf rate "$1" burst "$burst" latency 20ms && echo "$burst"
}
drops() { # packets the two qdiscs dropped so far
  { tc -n $NS0 -s qdisc show dev $IF0; tc -n $NS1 -s qdisc show dev $IF1; } 2>/dev/null |
    sed -n 's/.*(dropped \([0-9]*\),.*/\1/p' | awk '{ s += $1 } END { print s + 0 }'
}

job=0
# run_pair WIRE STEPS LOGPREFIX: the two ranks, one per namespace; prints rank 0's output into LOG.0
run_pair() {
  local wire=$1 steps=$2 log=$3 port=$((PORT + 2 * (job % 500))) id="ddp-net-$$-$job" r ns ifn rc=0 p
  job=$((job + 1))
  pids=()
  for r in 1 0; do
    if [ $r -eq 0 ]; then ns=$NS0 ifn=$IF0; else ns=$NS1 ifn=$IF1; fi
    timeout -k 5 "$TMO" ip netns exec $ns env RANK=$r WORLD_SIZE=2 MASTER_ADDR=$ADDR0 MASTER_PORT=$port \
      DDP_JOB_ID="$id" GLOO_SOCKET_IFNAME=$ifn "$trainer" --comm gloo --compression "$wire" --steps "$steps" \
      --quiet >"$log.$r" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  pids=()
  return $rc
}

mkdir -p "$out"
tmp=$(mktemp -d)
trap 'teardown; rm -rf "$tmp"' EXIT
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date +%s)
say "two hosts as network namespaces ($NS0: $ADDR0 on $IF0, $NS1: $ADDR1 on $IF1), a veth pair shaped by tc tbf"
say "rates: $RATES; wires: $WIRES; $RUNS runs each of $STEPS steps; load before: $load_before"

# A short unshaped run first: the trainer, Gloo and the path work (else say why and stop).
if ! run_pair none 3 "$tmp/probe"; then
  if grep -q "built without Gloo" "$tmp/probe.0" "$tmp/probe.1" 2>/dev/null; then
    skip "this libddp has no Gloo (install libgloo-dev and rebuild)"
  fi
  say "the trainer over Gloo between the namespaces failed:"; tail -n 5 "$tmp/probe.0" "$tmp/probe.1"
  exit 1
fi

fail=0
json="$tmp/runs.jsonl"; : >"$json"; : >"$tmp/rates"
# Round k runs every rate, and within it every wire, so that a change of the machine's load hits every
# row alike (the link is reshaped between rates: tc qdisc replace).
declare -A burst_of dropped_of
for ((k = 1; k <= RUNS; ++k)); do
  for rate in $RATES; do
    burst=$(shape "$rate") || { say "tc could not shape $IF0/$IF1 to $rate (tbf missing?)"; fail=1; continue; }
    burst_of[$rate]=$burst
    d0=$(drops)
    for w in $WIRES; do
      load1=$(cut -d' ' -f1 /proc/loadavg)
      t0=$(date +%s.%N)
      if ! run_pair "$w" "$STEPS" "$tmp/run"; then
        say "$rate $w run $k failed:"; tail -n 3 "$tmp/run.0" "$tmp/run.1" | sed 's/^/  /'
        fail=1; continue
      fi
      t1=$(date +%s.%N)
      step=$(sed -n 's/^step time: median \([0-9.]*\) ms.*/\1/p' "$tmp/run.0")
      read -r flight exposed < <(sed -n 's/^overlap: buckets in flight \([0-9.]*\) ms per step, \([0-9.]*\) ms of it exposed.*/\1 \2/p' "$tmp/run.0")
      loss=$(sed -n 's/^loss [0-9.]* -> \([0-9.]*\) over.*/\1/p' "$tmp/run.0")
      [ -n "$step" ] && [ -n "${exposed:-}" ] || { say "$rate $w run $k: no step time in the trainer's output"; fail=1; continue; }
      printf '{"rate":"%s","rate_bits":%s,"wire":"%s","run":%d,"step_ms":%s,"exposed_ms":%s,"in_flight_ms":%s,"final_loss":%s,"wall_s":%.2f,"load1_before":%s}\n' \
        "$rate" "$(rate_bits "$rate")" "$w" "$k" "$step" "$exposed" "$flight" "${loss:-null}" \
        "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b - a}')" "$load1" >>"$json"
    done
    dropped_of[$rate]=$(( ${dropped_of[$rate]:-0} + $(drops) - d0 ))
  done
done
for rate in $RATES; do
  [ -n "${burst_of[$rate]:-}" ] && echo "$rate ${burst_of[$rate]} ${dropped_of[$rate]:-0}" >>"$tmp/rates"
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
took=$(($(date +%s) - start))

# The tables, the estimate of where each wire starts to pay, and network.json.
awk -v runs="$RUNS" -v steps="$STEPS" -v wires="$WIRES" -v rates="$RATES" -v ratesfile="$tmp/rates" \
    -v lb="$load_before" -v la="$load_after" -v took="$took" -v jsonout="$out/network.json" '
function med(key,   n, i, j, t, v) {
  n = cnt[key]; if (n == 0) return -1
  for (i = 1; i <= n; ++i) v[i] = val[key, i]
  for (i = 2; i <= n; ++i) { t = v[i]; for (j = i - 1; j >= 1 && v[j] > t; --j) v[j + 1] = v[j]; v[j + 1] = t }
  return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
}
function field(s, name,   m) {
  if (match(s, "\"" name "\":[^,}]*")) { m = substr(s, RSTART + length(name) + 3, RLENGTH - length(name) - 3); gsub(/"/, "", m); return m }
  return ""
}
FILENAME == ratesfile { burst[$1] = $2; dropped[$1] = $3; next }
{ line[++nl] = $0; r = field($0, "rate"); w = field($0, "wire"); bits[r] = field($0, "rate_bits")
  k = r SUBSEP w; c = ++cnt[k "s"]; val[k "s", c] = field($0, "step_ms"); cnt[k "e"] = c; val[k "e", c] = field($0, "exposed_ms") }
END {
  nr = split(rates, R, " "); nw = split(wires, W, " ")
  for (i = 1; i <= nr; ++i) {
    r = R[i]
    printf "\n## network: %s (tbf, burst %s B, latency 20 ms, both directions; %d packets dropped by the qdiscs)\n\n", r, burst[r], dropped[r]
    printf "example trainer (9.46M parameters), 2 ranks over Gloo in two namespaces, %d steps a run, median of %d runs\n\n", steps, runs
    print "| wire | median step ms | median exposed comm ms | step over fp32 (none) |"
    print "|---|---:|---:|---:|"
    base = med(r SUBSEP "none" "s")
    for (j = 1; j <= nw; ++j) {
      w = W[j]; s = med(r SUBSEP w "s"); e = med(r SUBSEP w "e")
      ms[r, w] = s
      if (s < 0) { printf "| %s | failed | | |\n", w; continue }
      printf "| %s | %.1f | %.1f | %s |\n", w, s, e, (base > 0 ? sprintf("%.3f", s / base) : "-")
    }
  }
  # Where a wire starts to pay: step = a + b / bandwidth through the first two rates, for fp32 and the
  # wire; the two lines cross at b_delta / a_delta (an estimate: the fixed part is CPU-bound work).
  if (nr >= 2 && bits[R[1]] != bits[R[2]]) {
    x1 = 1e9 / bits[R[1]]; x2 = 1e9 / bits[R[2]]
    y1 = ms[R[1], "none"]; y2 = ms[R[2], "none"]
    if (y1 > 0 && y2 > 0 && (y1 - y2) * (x1 - x2) <= 0) {
      printf "\nno estimate of where each wire starts to pay: fp32 was not faster on the faster link (%.1f ms at %s, %.1f ms at %s):\nthe CPU, not the link, bounded the steps (a loaded machine? see load1_before in network.json)\n", y1, R[1], y2, R[2]
      nofit = 1
    }
  }
  if (nr >= 2 && bits[R[1]] != bits[R[2]] && !nofit) {
    printf "\nwhere each wire starts to pay (step = a + b / bandwidth through %s and %s; an estimate):\n\n", R[1], R[2]
    print "| wire | a (ms) | b (ms at 1 Gbit/s) | faster than fp32 below |"
    print "|---|---:|---:|---:|"
    for (j = 1; j <= nw; ++j) {
      w = W[j]; y1 = ms[R[1], w]; y2 = ms[R[2], w]
      if (y1 < 0 || y2 < 0 || y1 == "" || y2 == "") continue
      b[w] = (y1 - y2) / (x1 - x2); a[w] = y1 - b[w] * x1
      if (w == "none") { printf "| none | %.1f | %.1f | - |\n", a[w], b[w]; continue }
      da = a[w] - a["none"]; db = b["none"] - b[w]
      if (db <= 0) be = (da < 0 ? "every bandwidth" : "never")
      else if (da <= 0) be = "every bandwidth"
      else be = sprintf("%.1f Gbit/s", db / da)
      printf "| %s | %.1f | %.1f | %s |\n", w, a[w], b[w], be
    }
  }
  printf "{\"bench\":\"network\",\"steps\":%d,\"runs_per_wire\":%d,\"load_before\":\"%s\",\"load_after\":\"%s\",\"took_s\":%d,\n \"rates\":[", steps, runs, lb, la, (took + 0) > jsonout
  for (i = 1; i <= nr; ++i) printf "%s{\"rate\":\"%s\",\"burst_bytes\":%s,\"latency_ms\":20,\"dropped_packets\":%s}", (i > 1 ? "," : ""), R[i], burst[R[i]] + 0, (dropped[R[i]] + 0) > jsonout
  printf "],\n \"runs\":[\n" > jsonout
  for (i = 1; i <= nl; ++i) printf "  %s%s\n", line[i], (i < nl ? "," : "") > jsonout
  print " ]}" > jsonout
}' "$tmp/rates" "$json" || fail=1
echo
say "done in $took s; raw numbers in $out/network.json; load before: $load_before, after: $load_after"
exit $fail
