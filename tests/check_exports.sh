#!/usr/bin/env bash
# The shared library exports the API alone: every defined dynamic symbol starts with ddp_.
lib=$1
syms=$(nm -D --defined-only "$lib" | awk '{print $3}' | grep -v '^$')
bad=$(echo "$syms" | grep -v '^ddp_' || true)
n=$(echo "$syms" | grep -c '^ddp_')
if [ -n "$bad" ]; then
  echo "exports: symbols outside the API:"; echo "$bad" | head -20
  echo "exports: 0 passed, 1 failed"; exit 1
fi
soname=$(readelf -d "$lib" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
case "$soname" in
  libddp.so.[0-9]*) echo "exports: $n ddp_* symbols, soname $soname"; echo "exports: 1 passed, 0 failed" ;;
  *) echo "exports: bad soname '$soname'"; echo "exports: 0 passed, 1 failed"; exit 1 ;;
esac
