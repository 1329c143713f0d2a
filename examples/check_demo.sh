#!/usr/bin/env bash
# The demo suite: make demo as a new user runs it, with the ranks as threads of one process (the
# default of a build without MPI and Gloo, which needs nothing installed), at 2 and 3 ranks: the ranks
# agree at every step, the loss falls, the table is short, the overlap is reported, and the merged
# timeline it points to holds every rank's events.
# Usage: check_demo.sh "<make command>" BUILD
make_cmd=$1 build=$2
p=0 f=0
check() {  # check NAME OK DETAIL
  if [ "$2" = 1 ]; then p=$((p + 1)); echo "ok: $1"; else f=$((f + 1)); echo "FAILED: $1: $3"; fi
}
for np in 2 3; do
  tl=$build/demo-suite/np$np/timeline.json
  rm -rf "$(dirname "$tl")"
  out=$(timeout 300 $make_cmd demo DEMO_COMM=local DEMO_NP=$np DEMO_TIMELINE="$tl" DEMO_ARGS="--steps 16 --batch 16" 2>&1)
  rc=$?
  ok=0
  [ $rc -eq 0 ] && grep -q "^mlp_trainer: $np ranks over local" <<<"$out" &&
    grep -q "^ranks agree: losses and parameters identical on all $np ranks at every step" <<<"$out" && ok=1
  check "make demo, $np ranks as threads: the ranks agree" $ok "exit $rc; $(tail -n 5 <<<"$out")"
  rows=$(grep -cE '^step +[0-9]+/16  loss' <<<"$out")
  ok=0; [ "$rows" -ge 3 ] && [ "$rows" -le 10 ] && ok=1
  check "make demo, $np ranks: a short table of losses ($rows rows for 16 steps)" $ok "$rows rows"
  ok=0; grep -qE '^loss [0-9.]+ -> [0-9.]+ over 16 steps' <<<"$out" && grep -qE '^overlap: .*% hidden behind backward' <<<"$out" && ok=1
  check "make demo, $np ranks: the loss and the overlap reported" $ok "$(grep -E '^(loss|overlap)' <<<"$out")"
  merged=${tl%.json}.merged.json
  ok=0
  if grep -qF "== timeline of every rank in one trace: $merged" <<<"$out" && [ -s "$merged" ]; then
    python3 - "$merged" "$np" <<'PY' && ok=1
import json, sys
events = json.load(open(sys.argv[1]))
ranks = {e["pid"] for e in events if e.get("ph") == "X"}
sys.exit(0 if ranks == set(range(int(sys.argv[2]))) else 1)
PY
  fi
  check "make demo, $np ranks: the merged timeline it names holds every rank's spans" $ok "$(grep timeline <<<"$out")"
done
echo "demo: $p passed, $f failed"
[ $f -eq 0 ]
