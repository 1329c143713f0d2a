#!/usr/bin/env bash
# make bench: the ten benchmarks in turn. Tables go to stdout, raw numbers to OUT/*.json, figures to
# OUT/figures/*.svg.
# Usage: bench/run.sh path/to/ddp_bench OUTDIR   (MPIRUN: the launcher up to -np; NP: ranks, 2)
set -u
bin=$1; out=$2
MPIRUN=${MPIRUN:-mpirun --oversubscribe -np}
NP=${NP:-2}
mkdir -p "$out"
rm -f "$out/compressed_training.jsonl"
here=$(cd "$(dirname "$0")" && pwd)
fail=0
step() { echo; echo "=== $*"; }
run() { timeout "$1" env $MPIRUN "${@:2}" || { echo "bench: '${*:2}' failed (exit $?)"; fail=1; }; }
echo "machine: $(nproc) cores, $(sed -n 's/^model name[^:]*: //p' /proc/cpuinfo | head -n 1), $(free -g | awk '/Mem:/{print $2}') GiB; load: $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s)

step "1. hook";      run 120 1 "$bin" hook "$out"
step "2. bucketing"; run 240 "$NP" "$bin" bucketing "$out"
step "3. overlap";   run 120 "$NP" "$bin" overlap "$out"
step "4. PyTorch"
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  env $MPIRUN 1 "$bin" sizes - > "$out/grad_sizes.txt"
  torch_out=$(timeout 300 /usr/bin/python3 "$here/torch_ddp.py" run "$out" "$NP" "$out/grad_sizes.txt") || { echo "bench: torch_ddp.py failed"; fail=1; }
  echo "$torch_out" | grep -v '^pace '
  pace=$(echo "$torch_out" | sed -n 's/^pace //p')
  run 180 "$NP" "$bin" lastready "$out" $pace
  # Horovod, the second peer, where it is installed for /usr/bin/python3 (PYTHONPATH may point to it;
  # docs/performance.md, section 4, says how it was built here).
  rm -f "$out/lastready_horovod.json"
  if /usr/bin/python3 -c 'import horovod.torch' 2>/dev/null; then
    run 300 "$NP" ${PYTHONPATH:+-x PYTHONPATH} /usr/bin/python3 "$here/horovod_bench.py" "$out" "$out/grad_sizes.txt"
  else
    echo "4. Horovod not found for /usr/bin/python3 (import horovod.torch failed): libddp against torch DDP only"
  fi
  /usr/bin/python3 "$here/torch_ddp.py" report "$out" || fail=1
else
  echo "4. PyTorch not found: /usr/bin/python3 has no torch (apt-get install python3-torch); libddp side only"
  run 120 "$NP" "$bin" lastready "$out"
fi
step "5. memory"
run 120 "$NP" "$bin" memory "$out" copy
run 120 "$NP" "$bin" memory "$out" arena
/usr/bin/python3 - "$out" <<'PY' || fail=1
import json, sys
out = sys.argv[1]
rows = [json.load(open(f"{out}/memory_{l}.json")) for l in ("copy", "arena")]
g = rows[0]["grad_bytes"]
print(f"\n## 5. memory beyond the grads ({g / 1e6:.0f} MB of f32 grads, message_size 10M, 2 ranks, largest rank)\n")
print("| layout | library_bytes MB | of which arena MB | library beyond grads | x grads | RSS beyond grads | x grads | peak RSS beyond grads | x grads |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['layout']} | {r['library_bytes'] / 1e6:.1f} | {r['arena_bytes'] / 1e6:.1f} | {r['library_beyond_grads'] / 1e6:.1f} MB | "
          f"{r['library_beyond_grads'] / g:.4f} | {r['rss_beyond_grads'] / 1e6:.1f} MB | {r['rss_beyond_grads'] / g:.4f} | "
          f"{r['peak_rss_beyond_grads'] / 1e6:.1f} MB | {r['peak_rss_beyond_grads'] / g:.4f} |")
c, a = rows[0]["library_beyond_grads"] / g, rows[1]["library_beyond_grads"] / g
print(f"\ntargets: arena < 1% of the grads: {a:.4f} {'met' if a < 0.01 else 'MISSED'}; copy <= 1x: {c:.4f} {'met' if c <= 1 else 'MISSED'}")
json.dump({"bench": "memory", "runs": rows}, open(f"{out}/memory.json", "w"), indent=1)
PY
step "6. sharded"; run 240 "$NP" "$bin" sharded "$out"
step "7. compressed wires"; run 300 "$NP" "$bin" compressed "$out"
# Training with each wire: the example trainer's final loss against the uncompressed run's.
trainer=$(dirname "$bin")/../examples/mlp_trainer
if [ -x "$trainer" ]; then
  echo; echo "training (examples/mlp_trainer, $NP ranks, 60 steps, SGD): final loss per wire"
  echo; echo "| wire | first loss | final loss | over fp32's |"; echo "|---|---:|---:|---:|"
  base=""
  for c in none bf16 fp16 int8; do
    line=$(timeout 300 env $MPIRUN "$NP" "$trainer" --steps 60 --compression $c --quiet 2>&1 |
           sed -n 's/^loss \([0-9.]*\) -> \([0-9.]*\) over.*/\1 \2/p')
    [ -n "$line" ] || { echo "bench: the trainer with --compression $c failed"; fail=1; continue; }
    read -r first last <<<"$line"
    [ -z "$base" ] && base=$last
    echo "| $c | $first | $last | $(awk -v a="$last" -v b="$base" 'BEGIN{printf "%.4f", a / b}') |"
    echo "{\"wire\":\"$c\",\"first_loss\":$first,\"final_loss\":$last}" >> "$out/compressed_training.jsonl"
  done
  echo; echo "target: every wire's final loss within 1% of fp32's (see the last column)"
fi
# 8. The wires over an emulated network between two namespaces (root only; it says why it skips).
step "8. network (bench/netns_wires.sh; alone: make bench-network)"
if [ -x "$trainer" ]; then "$here/netns_wires.sh" "$trainer" "$out" || { echo "bench: netns_wires.sh failed"; fail=1; }
else echo "network: skipped: no example trainer at $trainer"; fi
# 9. The compressed wires' host loops, pass by pass, against memcpy (one process).
step "9. host conversions"
if [ -x "$(dirname "$bin")/host_loops" ]; then timeout 300 "$(dirname "$bin")/host_loops" "$out" || { echo "bench: host_loops failed"; fail=1; }
else echo "host conversions: skipped: no $(dirname "$bin")/host_loops"; fi
# 10. One iteration's cost against the world size, over MPI and over Gloo (more ranks than cores:
# read the growth, not the times).
step "10. world size (WORLD_SIZES: ${WORLD_SIZES:-1 2 4 8})"
echo; echo "| ranks | comm | gradients | libddp ms | MPI_Allreduce floor ms | over the floor |"; echo "|---:|---|---|---:|---:|---:|"
rm -f "$out"/worldsize_*np*.json
for n in ${WORLD_SIZES:-1 2 4 8}; do
  run 120 "$n" "$bin" worldsize "$out"
  port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  BENCH_GLOO="tcp://127.0.0.1:$port" run 120 "$n" -x BENCH_GLOO "$bin" worldsize "$out"
done
# The figures (matplotlib), from the JSON above: OUT/figures/*.svg.
step "figures"
/usr/bin/python3 "$here/figures.py" "$out" || { echo "bench: figures.py failed"; fail=1; }
echo
echo "bench: done in $(( $(date +%s) - start )) s; raw numbers in $out/*.json; load after: $(cut -d' ' -f1-3 /proc/loadavg)"
exit $fail
