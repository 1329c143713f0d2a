#!/usr/bin/env bash
# Makes sure the packages that the test suites need (tools/packages.txt) are installed. As root on
# Debian it installs the missing ones with apt-get (once: later runs find them and say nothing);
# otherwise it names the missing packages and the exact command that installs them, and fails.
#   tools/setup.sh            check, and install as root
#   tools/setup.sh --check    only check: exit 1 naming what is missing
#   tools/setup.sh --list     print the package names, one line
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
pkgs=$(sed -e 's/#.*//' "$here/packages.txt" | tr -s ' \n' ' ' | sed -e 's/^ //' -e 's/ $//')
if [ "${1:-}" = --list ]; then echo "$pkgs"; exit 0; fi

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "setup: not a Debian system, so the packages cannot be checked: install the equivalents of" \
       "'$pkgs' with your package manager, then run make test with SETUP=0" >&2
  exit 1
fi
missing=""
for p in $pkgs; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing="$missing $p"
done
missing=${missing# }
[ -z "$missing" ] && exit 0

cmd="apt-get update && apt-get install -y --no-install-recommends $missing"
if [ "${1:-}" = --check ] || [ "$(id -u)" -ne 0 ]; then
  echo "setup: missing packages: $missing; install them with: sudo sh -c '$cmd'" \
       "(or run make test as root, which installs them; SETUP=0 skips this check)" >&2
  exit 1
fi
echo "setup: installing the test suites' packages (tools/packages.txt), a few minutes the first time: $missing"
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing; } >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  echo "setup: apt-get failed (above); the command was: $cmd" >&2
  rm -f "$log"
  exit 1
fi
rm -f "$log"
echo "setup: installed $missing"
