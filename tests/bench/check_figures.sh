#!/usr/bin/env bash
# The figures suite: bench/figures.py over recorded make bench JSON (tests/bench/fixtures: what real
# runs wrote, rank 0's overlap timeline among it; the hook's launch times cut to 200). A figure per
# section is drawn as well-formed SVG; the break-even bandwidths it marks are those section 8's own table gave for the
# same runs (bf16 7.5, fp16 8.6, int8 6.9 Gbit/s); the same JSON draws the same bytes; a section that
# left no JSON is skipped by name; JSON missing a field fails with the file's directory named.
# Prints "figures: P passed, F failed[, S skipped]".
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
py=${PYTHON:-/usr/bin/python3}
if ! "$py" -c 'import matplotlib' 2>/dev/null; then
  echo "figures: skipped: $py has no matplotlib (apt-get install python3-matplotlib)"
  echo "figures: 0 passed, 0 failed, 1 skipped"
  exit 0
fi
tp=0 tf=0
check() {  # name, ok (0/1), detail
  if [ "$2" = 1 ]; then tp=$((tp + 1)); echo "  ok   $1"; else tf=$((tf + 1)); echo "  FAIL $1: $3"; fi
}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/a" "$tmp/b" "$tmp/none" "$tmp/bad"
cp "$here"/fixtures/*.json "$tmp/a/"; cp "$here"/fixtures/*.json "$tmp/b/"

out=$("$py" "$root/bench/figures.py" "$tmp/a" 2>&1); rc=$?
ok=1; [ $rc -eq 0 ] || ok=0
figs="hook bucketing overlap peers memory sharded compressed wires conversions worldsize"
for f in $figs; do
  "$py" -c 'import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); sys.exit(0 if r.tag.endswith("svg") else 1)' \
    "$tmp/a/figures/$f.svg" 2>/dev/null || ok=0
done
check "a figure per section (ten) drawn as well-formed SVG" $ok "exit $rc; $out"
ok=0; grep -q "where each pays: bf16: below 7.5 Gbit/s, fp16: below 8.6 Gbit/s, int8: below 6.9 Gbit/s" <<<"$out" && ok=1
check "the break-even bandwidths are section 8's for the same runs" $ok "$out"
ok=0; grep -q "overlap.svg: iteration 1, 6 buckets, 5 of them done before the last grad was ready" <<<"$out" && ok=1
check "the overlap figure draws the timeline's last iteration: 6 buckets, 5 done during the backward" $ok "$out"
ok=0; grep -q "worldsize.svg: 2 gradient sets at 1, 2, 4, 8 ranks" <<<"$out" && ok=1
check "the world-size figure has every world size and both gradient sets" $ok "$out"

ok=0; grep -q "^peers.svg: 7 runs, Horovod included" <<<"$out" && grep -q "^hook.svg: 200 iterations, median 65.5 ns" <<<"$out" &&
  grep -q "^sharded.svg: reduce-scatter + all-gather 0.923x the allreduce path" <<<"$out" && ok=1
check "the sections' bars hold their JSON: libddp, torch DDP and Horovod; the hook's median; sharded over allreduce" $ok "$out"

"$py" "$root/bench/figures.py" "$tmp/b" >/dev/null 2>&1
ok=1; for f in $figs; do cmp -s "$tmp/a/figures/$f.svg" "$tmp/b/figures/$f.svg" || ok=0; done
check "the same JSON draws the same bytes" $ok "the SVGs differ"

out=$("$py" "$root/bench/figures.py" "$tmp/none" 2>&1); rc=$?
ok=0; [ $rc -eq 0 ] && grep -q "^wires.svg: skipped: no network.json" <<<"$out" &&
  grep -q "^overlap.svg: skipped" <<<"$out" && grep -q "^worldsize.svg: skipped" <<<"$out" &&
  grep -q "^peers.svg: skipped: no pytorch.json (section 4)" <<<"$out" && [ "$(grep -c ': skipped' <<<"$out")" = 10 ] && ok=1
check "sections that left no JSON are skipped by name (all ten), exit 0" $ok "exit $rc; $out"

cp "$here"/fixtures/*.json "$tmp/bad/"
"$py" -c 'import json, sys; p = sys.argv[1]; d = json.load(open(p)); del d["compute_ms"]; json.dump(d, open(p, "w"))' "$tmp/bad/overlap.json"
out=$("$py" "$root/bench/figures.py" "$tmp/bad" 2>&1); rc=$?
ok=0; [ $rc -eq 1 ] && grep -q "figure_overlap: failed on the JSON in $tmp/bad: KeyError: 'compute_ms'" <<<"$out" &&
  [ -f "$tmp/bad/figures/wires.svg" ] && ok=1
check "JSON missing a field fails that figure by name (exit 1), the others are still drawn" $ok "exit $rc; $out"

out=$("$py" "$root/bench/figures.py" "$tmp/a" gif 2>&1); rc=$?
ok=0; [ $rc -eq 2 ] && grep -q "^usage: bench/figures.py OUTDIR" <<<"$out" && ok=1
check "an unknown format is refused with the usage" $ok "exit $rc; $out"

echo "figures: $tp passed, $tf failed"
[ "$tf" -eq 0 ]
