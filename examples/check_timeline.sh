#!/usr/bin/env bash
# The timeline suite: runs a short demo on 2 ranks with DDP_TIMELINE set, then checks each rank's
# Chrome trace: valid JSON, one "bucket" span per bucket per iteration (with names and the ready /
# launch / done times), one grad-ready mark per grad per iteration, one span per iteration.
# Usage: check_timeline.sh path/to/mlp_trainer   (MPIRUN: the launcher up to -np, BUILD: the build dir)
bin=$1
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun --oversubscribe -np}
dir=$BUILD/timeline; rm -rf "$dir"; mkdir -p "$dir"
steps=4; pass=0; fail=0
for layout in arena copy; do
  out=$(DDP_TIMELINE=$dir/$layout.json timeout 120 env $MPIRUN 2 "$bin" --steps $steps --batch 8 --layout $layout --quiet 2>&1)
  rc=$?
  if [ $rc -ne 0 ]; then echo "$out" | tail -n 20; echo "timeline: the $layout demo failed (exit $rc)"; fail=$((fail + 1)); continue; fi
  buckets=$(echo "$out" | sed -nE 's/.* ([0-9]+) buckets .*/\1/p' | head -n 1)
  if /usr/bin/env python3 - "$dir" "$layout" "$steps" "$buckets" <<'PY'
import json, sys, collections
d, layout, steps, buckets = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
bad = []
for rank in (0, 1):
    path = f"{d}/{layout}.rank{rank}.json"
    try:
        doc = json.load(open(path))
    except Exception as e:
        bad.append(f"{path}: not valid JSON: {e}"); continue
    ev = doc["traceEvents"] if isinstance(doc, dict) else doc
    spans = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "bucket"]
    per_iter = collections.Counter(e["args"]["iteration"] for e in spans)
    if sorted(per_iter) != list(range(steps)) or any(n != buckets for n in per_iter.values()):
        bad.append(f"{path}: bucket spans per iteration {dict(per_iter)}, want {buckets} in each of {steps}")
    for e in spans:
        a = e["args"]
        if not e["name"].startswith("bucket ") or e["dur"] < 0 or not (a["ready_us"] <= a["launch_us"] <= a["done_us"]):
            bad.append(f"{path}: malformed span {e}"); break
        names = collections.Counter((e["args"]["iteration"], e["name"]) for e in spans)
    if any(v != 1 for v in names.values()):
        bad.append(f"{path}: a bucket appears twice in one iteration")
    marks = [e for e in ev if e.get("ph") == "i" and e.get("cat") == "grad"]
    if len(marks) != 8 * steps:
        bad.append(f"{path}: {len(marks)} grad-ready marks, want {8 * steps}")
    iters = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "iteration"]
    if len(iters) != steps:
        bad.append(f"{path}: {len(iters)} iteration spans, want {steps}")
    print(f"  {path}: {len(ev)} events, {len(spans)} bucket spans, {len(marks)} grad marks")
for b in bad: print("  FAIL", b)
sys.exit(1 if bad else 0)
PY
  then pass=$((pass + 1)); else fail=$((fail + 1)); fi
done
echo "timeline: $pass passed, $fail failed"
[ $fail -eq 0 ]
