#!/usr/bin/env bash
# Runs each suite (make suite-NAME) and sums their summary lines into one:
#   "N passed, N failed, N skipped"
# A suite's summary is its last line of the form "[word: ]N passed, N failed[, N skipped]" or doctest's
# "[doctest] test cases: T | P passed | F failed | S skipped". A suite that ends without one, or exits
# non-zero with no failure counted, counts as one failure.
make_cmd=$1; shift
# A suite's binaries are built on every core (the suites themselves still run one at a time, each
# make given one suite); a make that has its own jobs (make -jN test) shares them instead.
case " ${MAKEFLAGS:-} " in
  *jobserver* | *" -j"*) ;;
  *) make_cmd="$make_cmd -j$(nproc 2>/dev/null || echo 2)" ;;
esac
BUILD=${BUILD:-build}; mkdir -p "$BUILD/logs"
tp=0; tf=0; ts=0; bad=()
for s in "$@"; do
  echo "=== $s"
  log=$BUILD/logs/$s.log
  $make_cmd suite-$s > >(tee "$log") 2>&1
  rc=$?
  wait
  line=$(grep -E '^([A-Za-z0-9_-]+: )?[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$' "$log" | tail -n 1)
  if [ -n "$line" ]; then
    p=$(sed -E 's/.*\b([0-9]+) passed.*/\1/' <<<"$line"); f=$(sed -E 's/.*\b([0-9]+) failed.*/\1/' <<<"$line")
    k=$(grep -oE '[0-9]+ skipped' <<<"$line" | grep -oE '[0-9]+' || echo 0)
  else
    line=$(grep -E '^\[doctest\] test cases:' "$log" | tail -n 1)
    if [ -n "$line" ]; then
      p=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+'); f=$(grep -oE '[0-9]+ failed' <<<"$line" | grep -oE '[0-9]+')
      k=$(grep -oE '[0-9]+ skipped' <<<"$line" | grep -oE '[0-9]+' || echo 0)
    else
      p=0; f=1; k=0; echo "--- $s: no summary line (exit $rc)"
    fi
  fi
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; echo "--- $s: exit $rc with no failure counted"; fi
  [ "$f" -gt 0 ] && bad+=("$s")
  tp=$((tp + p)); tf=$((tf + f)); ts=$((ts + k))
done
# What failed, again at the end, where a shortened log still shows it.
for s in "${bad[@]}"; do
  echo "--- $s failed ($BUILD/logs/$s.log):"
  grep -E -A2 'FAIL|panicked|ERROR|Error|error:|no summary|sanitizer' "$BUILD/logs/$s.log" | cut -c1-400 | head -n 24
done
[ ${#bad[@]} -gt 0 ] && echo "failing suites: ${bad[*]}"
echo "$tp passed, $tf failed, $ts skipped"
[ "$tf" -eq 0 ]
