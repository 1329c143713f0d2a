#!/usr/bin/env bash
# Runs the GPU doctest program and turns doctest's summary into the suite's line
#   "gpu: P passed, F failed, S skipped"
# Without a visible CUDA device every test case is skipped (the program says why, once).
bin=$1; shift
out=$("$bin" --no-version "$@" 2>&1); rc=$?
echo "$out" | tail -n 60
line=$(echo "$out" | grep -E '^\[doctest\] test cases:' | tail -n 1)
if [ -z "$line" ]; then echo "gpu: 0 passed, 1 failed, 0 skipped (no doctest summary, exit $rc)"; exit 1; fi
p=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+'); f=$(grep -oE '[0-9]+ failed' <<<"$line" | grep -oE '[0-9]+')
s=$(grep -oE '[0-9]+ skipped' <<<"$line" | grep -oE '[0-9]+' || echo 0)
[ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && f=1
# GPU_PROBE (tests/gpu/check_device.cpp): one more case, that the probe tests/gpu/run.sh relies on
# agrees with the skip rule: it fails naming "no CUDA device" exactly when every case skipped.
if [ -n "${GPU_PROBE:-}" ]; then
  probe=$("$GPU_PROBE" 2>&1); prc=$?
  echo "gpu: probe: $probe (exit $prc)"
  if [ "$p" -eq 0 ] && [ "$f" -eq 0 ] && [ "$s" -gt 0 ]; then
    [ "$prc" -ne 0 ] && grep -q '^no CUDA device: ' <<<"$probe"
  else
    [ "$prc" -eq 0 ]
  fi && p=$((p + 1)) || { f=$((f + 1)); echo "gpu: the probe disagrees with the tests about the device"; }
fi
echo "gpu: $p passed, $f failed, $s skipped"
[ "$f" -eq 0 ]
