#!/usr/bin/env bash
# The timeline suite: runs a short demo on 2 ranks with DDP_TIMELINE set, then checks each rank's
# Chrome trace: the array form (one event per line), complete JSON once the process has ended; one
# "bucket" span per bucket per iteration (with the ready / launch / done times), one grad-ready mark
# per grad per iteration, one span per iteration; timestamps in microseconds since the Unix epoch;
# the process ("rank N") and thread ("trainer", "stream N") names. Then the merge script
# (tools/merge_timeline.py): files cut at a random event boundary, or inside an event, still load
# and merge; the merged trace holds every rank on one time base. Last, a demo killed with SIGKILL
# after a few iterations leaves a file that loads.
# Usage: check_timeline.sh path/to/mlp_trainer   (MPIRUN: the launcher up to -np, BUILD: the build dir,
# SEED: the seed of the random cuts, default the time)
bin=$1
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun --oversubscribe -np}
SEED=${SEED:-$(date +%s)}
merge=$(cd "$(dirname "$0")/.." && pwd)/tools/merge_timeline.py
dir=$BUILD/timeline; rm -rf "$dir"; mkdir -p "$dir"
steps=4; pass=0; fail=0
echo "timeline: seed $SEED (SEED=$SEED repeats the random cuts)"

# What a trace viewer does with the array form (catapult's JSON importer; Perfetto reads it as a
# stream): a missing closing bracket and a trailing comma are forgiven. Shared by the checks below.
cat > "$dir/viewer.py" <<'PY'
import json, re
def viewer_load(text):
    t = text.strip()
    if t.startswith("["):
        t = re.sub(r"\s*,\s*$", "", t)
        if not t.endswith("]"):
            t += "]"
    doc = json.loads(t)
    return doc["traceEvents"] if isinstance(doc, dict) else doc
PY

for layout in arena copy; do
  now=$(date +%s)
  out=$(DDP_TIMELINE=$dir/$layout.json timeout 120 env $MPIRUN 2 "$bin" --steps $steps --batch 8 --layout $layout --quiet 2>&1)
  rc=$?
  if [ $rc -ne 0 ]; then echo "$out" | tail -n 20; echo "timeline: the $layout demo failed (exit $rc)"; fail=$((fail + 1)); continue; fi
  buckets=$(echo "$out" | sed -nE 's/.* ([0-9]+) buckets .*/\1/p' | head -n 1)
  if /usr/bin/env python3 - "$dir" "$layout" "$steps" "$buckets" "$now" "$merge" "$SEED" <<'PY'
import collections, json, os, random, subprocess, sys
d, layout, merge = sys.argv[1], sys.argv[2], sys.argv[6]
steps, buckets, now, seed = (int(a) for a in (sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[7]))
sys.path.insert(0, d)
from viewer import viewer_load
bad = []
texts, events = {}, {}

def check_rank(rank, path, text):
    if not text.startswith("[\n"):
        bad.append(f"{path}: not the array form (starts with {text[:20]!r})"); return None
    lines = text.rstrip("\n").split("\n")
    if lines[-1] != "]":
        bad.append(f"{path}: no closing ']' although the process ended"); return None
    for ln in lines[1:-1]:  # one event per line, each but the last followed by a comma
        try:
            json.loads(ln[:-1] if ln.endswith(",") else ln)
        except ValueError:
            bad.append(f"{path}: a line that is not one event: {ln[:80]!r}"); return None
    try:
        ev = json.loads(text)
    except ValueError as e:
        bad.append(f"{path}: not valid JSON: {e}"); return None
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
    # One clock for every rank: microseconds since the Unix epoch, so within minutes of 'date +%s'.
    far = [e for e in ev if "ts" in e and abs(e["ts"] / 1e6 - now) > 300]
    if far:
        bad.append(f"{path}: {len(far)} timestamps not within 5 minutes of the epoch time {now}: {far[0]}")
    if any(e.get("pid") != rank for e in ev):
        bad.append(f"{path}: an event whose pid is not the rank {rank}")
    meta = {(e["name"], e.get("tid")): e["args"]["name"] for e in ev if e.get("ph") == "M" and "name" in e.get("args", {})}
    if meta.get(("process_name", None)) != f"rank {rank}":
        bad.append(f"{path}: process_name is {meta.get(('process_name', None))!r}, want 'rank {rank}'")
    want = {0: "trainer", **{e["tid"]: f"stream {e['tid'] - 1}" for e in spans}, 1: "stream 0"}
    for tid, name in sorted(want.items()):
        if meta.get(("thread_name", tid)) != name:
            bad.append(f"{path}: thread_name of tid {tid} is {meta.get(('thread_name', tid))!r}, want {name!r}")
    print(f"  {path}: {len(ev)} events, {len(spans)} bucket spans, {len(marks)} grad marks, "
          f"threads {sorted(v for (k, t), v in meta.items() if k == 'thread_name')}")
    return ev

def run_merge(out, *paths):
    p = subprocess.run([sys.executable, merge, "-q", "-o", out, *paths], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=60)
    if p.returncode != 0:
        bad.append(f"merge {paths}: exit {p.returncode}: {p.stdout.decode()[-300:]}"); return None
    return json.load(open(out))  # the merged trace is complete JSON

for rank in (0, 1):
    path = f"{d}/{layout}.rank{rank}.json"
    texts[rank] = open(path).read()
    events[rank] = check_rank(rank, path, texts[rank])

if events[0] is not None and events[1] is not None:
    rng = random.Random(seed)
    lines = texts[0].rstrip("\n").split("\n")[:-1]  # '[' and the events, without the ']'
    k = rng.randrange(1, len(lines) - 1)  # keep k events: the file of a process that died after writing them
    for what, cut in (("at an event boundary", "\n".join(lines[:1 + k]) + "\n"),
                      ("inside an event", "\n".join(lines[:1 + k]) + "\n" + lines[1 + k][:rng.randrange(1, len(lines[1 + k]))])):
        tpath = f"{d}/{layout}.cut.rank0.json"
        open(tpath, "w").write(cut)
        if what.startswith("at"):
            try:
                if len(viewer_load(cut)) != k:
                    bad.append(f"{tpath}: a viewer reads {len(viewer_load(cut))} events of a file cut after {k}")
            except ValueError as e:
                bad.append(f"{tpath}: cut after {k} events {what}: a viewer cannot load it: {e}")
        m = run_merge(f"{d}/{layout}.cut.merged.json", tpath, f"{d}/{layout}.rank1.json")
        if m is not None and len(m) != k + len(events[1]):
            bad.append(f"{tpath}: cut after {k} events {what}: the merge kept {len(m)}, want {k + len(events[1])}")
    print(f"  rank 0 cut after {k} of {len(lines) - 1} events (at a boundary and inside the next): merged")
    # Broken before its end (a partial event with events after it, as two writers of one file leave it;
    # text after the closing bracket): refused, naming the file and line, and nothing written.
    bpath, bout = f"{d}/{layout}.broken.rank0.json", f"{d}/{layout}.broken.merged.json"
    for what, text in (("a partial event mid-file", "\n".join(lines[:1 + k] + [lines[1 + k][:5]] + lines[1 + k:]) + "\n]\n"),
                       ("text after the closing bracket", texts[0] + texts[1])):
        open(bpath, "w").write(text)
        p = subprocess.run([sys.executable, merge, "-o", bout, bpath], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=60)
        msg = p.stdout.decode()
        if p.returncode != 1 or f"{bpath}: line " not in msg or "nothing merged" not in msg or os.path.exists(bout):
            bad.append(f"{bpath} ({what}): exit {p.returncode}, output {msg[-300:]!r}: not refused by line")
    print("  a file broken before its end: refused, naming the line")
    # A rank's second context writes <root>.ctx1.rank0.json: merged from the root path, as a process of its own.
    import shutil
    for name in ("rank0", "rank1", "ctx1.rank0"):
        shutil.copy(f"{d}/{layout}.rank{name[-1]}.json", f"{d}/{layout}g.{name}.json")
    m = run_merge(f"{d}/{layout}g.merged.json", f"{d}/{layout}g.json")
    if m is not None:
        pids = sorted({e["pid"] for e in m if "pid" in e})
        names = {e["args"]["name"] for e in m if e.get("name") == "process_name"}
        if pids != [0, 1, 100000] or "rank 0, context 1" not in names or len(m) != 2 * len(events[0]) + len(events[1]):
            bad.append(f"contexts merged: pids {pids}, names {sorted(names)}, {len(m)} events")
        else:
            print("  a second context's files merged as processes of their own")
    m = run_merge(f"{d}/{layout}.merged.json", f"{d}/{layout}.json")  # the DDP_TIMELINE path finds its ranks
    if m is not None:
        first = {}
        for e in m:
            if e.get("ph") != "M" and "ts" in e:
                first.setdefault(e["pid"], e["ts"])
        if sorted(first) != [0, 1] or len(m) != len(events[0]) + len(events[1]):
            bad.append(f"merged: ranks {sorted(first)} and {len(m)} events, want ranks [0, 1] and "
                       f"{len(events[0]) + len(events[1])} events")
        elif abs(first[0] - first[1]) > 5e6:
            bad.append(f"merged: the ranks' first events are {abs(first[0] - first[1]) / 1e6:.1f} s apart (one time base?)")
        else:
            print(f"  merged: {len(m)} events of ranks 0 and 1, first events {abs(first[0] - first[1]) / 1e3:.1f} ms apart")
for b in bad: print("  FAIL", b)
sys.exit(1 if bad else 0)
PY
  then pass=$((pass + 1)); else fail=$((fail + 1)); fi
done

# A crash: the demo (one process, the self communicator) is killed with SIGKILL once its file holds
# three iterations; what it wrote must load.
crash=$dir/crash.json
DDP_TIMELINE=$crash "$bin" --comm self --steps 1000000 --batch 8 --quiet >/dev/null 2>&1 &
pid=$!
for _ in $(seq 600); do
  n=$(grep -c '"cat":"iteration"' "$dir/crash.rank0.json" 2>/dev/null); [ "${n:-0}" -ge 3 ] && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.1
done
kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null; rc=$?
if /usr/bin/env python3 - "$dir/crash.rank0.json" "$rc" "$merge" <<'PY'
import json, os, subprocess, sys
path, rc, merge = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sys.path.insert(0, os.path.dirname(path))
from viewer import viewer_load
bad = []
if rc != 128 + 9:
    bad.append(f"the demo was not killed by SIGKILL (exit {rc})")
try:
    text = open(path).read()
    ev = viewer_load(text)
    iters = [e for e in ev if e.get("cat") == "iteration"]
    if len(iters) < 3:
        bad.append(f"{path}: {len(iters)} iterations on disk, want at least 3")
    out = path + ".merged"
    p = subprocess.run([sys.executable, merge, "-q", "-o", out, path], timeout=60)
    if p.returncode != 0 or len(json.load(open(out))) != len(ev):
        bad.append(f"{path}: the merge script did not keep its {len(ev)} events")
    print(f"  killed after {len(iters)} iterations: {path} loads ({len(ev)} events, "
          f"{'closed' if text.rstrip().endswith(']') else 'no closing bracket'})")
except (OSError, ValueError, KeyError) as e:
    bad.append(f"{path}: the file of the killed process does not load: {e}")
for b in bad: print("  FAIL", b)
sys.exit(1 if bad else 0)
PY
then pass=$((pass + 1)); else fail=$((fail + 1)); fi
echo "timeline: $pass passed, $fail failed"
[ $fail -eq 0 ]
