#!/usr/bin/env bash
# Prepares, where there is network, what tests/gpu/run.sh needs on a GPU machine that has none:
# doctest's header, from Debian's doctest-dev package (apt-get download, dpkg -x), into .gpu-deps/
# (git-ignored: nothing enters the tree). Bring .gpu-deps/ along with the tree. Needs apt-get and
# dpkg, not root. Usage: tests/gpu/prepare.sh
set -eu -o pipefail
cd "$(dirname "$0")/../.."
dest=.gpu-deps
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && apt-get download doctest-dev) >"$tmp/log" 2>&1; then
  cat "$tmp/log"
  echo "prepare: apt-get download doctest-dev failed (network, or no apt source that has it)"
  exit 1
fi
deb=$(ls "$tmp"/doctest-dev_*.deb)
rm -rf "$dest"
dpkg -x "$deb" "$dest"
header=$dest/usr/include/doctest/doctest.h
[ -f "$header" ] || { echo "prepare: $deb holds no usr/include/doctest/doctest.h"; exit 1; }
echo "prepare: $header from $(basename "$deb"); run tests/gpu/run.sh on the GPU machine"
