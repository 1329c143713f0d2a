#!/usr/bin/env bash
# The python suite, as a user gets the package: a wheel built from bindings/python (which builds the C
# library with make and ships it inside), installed into a fresh virtual environment (system site
# packages, for torch and pytest; no network), checked from /tmp with no variable set, then the tests
# run from outside the source tree against the installed package.
# Usage: run_suite.sh PYTHON VENV_DIR. Ends with "python: N passed, N failed, N skipped".
python=$1; venv=$2
here=$(cd "$(dirname "$0")" && pwd)
pass=0; fail=0
rm -rf "$venv"; mkdir -p "$venv"
log=$venv.log; : > "$log"
if ! "$python" -m venv --system-site-packages "$venv/env" >>"$log" 2>&1; then
  cat "$log"; echo "python: skipped: $python -m venv failed (apt-get install python3-venv)"
  echo "python: 0 passed, 0 failed, 1 skipped"; exit 0
fi
py=$venv/env/bin/python
if "$py" -m pip wheel -q --no-build-isolation --no-index --no-deps -w "$venv/wheel" "$here" >>"$log" 2>&1 \
   && "$py" -m pip install -q --no-index --no-deps "$venv"/wheel/libddp-*.whl >>"$log" 2>&1; then
  echo "ok: pip wheel ./bindings/python, pip install the wheel"; pass=$((pass + 1))
else
  cat "$log"; echo "FAILED: building or installing the wheel"; echo "python: $pass passed, 1 failed, 0 skipped"; exit 1
fi
# The wheel: py3-none-<platform> (a library loaded with ctypes, no CPython extension, yet not pure),
# versioned as include/ddp.h says, holding every module of the sources (subpackages included).
header_version=$(sed -nE 's/^#define DDP_VERSION_(MAJOR|MINOR|PATCH) ([0-9]+).*/\2/p' "$here/../../include/ddp.h" | paste -sd.)
wheel=$(ls "$venv"/wheel/libddp-*.whl)
wheel_meta=$("$py" -c '
import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = z.namelist()
src = os.path.dirname(sys.argv[2])
sources = [os.path.relpath(os.path.join(d, n), src) for d, _, ns in os.walk(sys.argv[2]) for n in ns if n.endswith(".py")]
missing = sorted(set(sources) - set(names))
text = [z.read(n).decode() for n in names if n.endswith((".dist-info/WHEEL", ".dist-info/METADATA"))]
for line in "\n".join(text).splitlines():
    if line.startswith(("Tag:", "Root-Is-Purelib:", "Version:")):
        print(line)
print("has-library:", "libddp/libddp.so.0" in names)
print("missing-modules:", " ".join(missing) or "none")' "$wheel" "$here/libddp" | sort)
plat=$("$py" -c 'import sysconfig; print(sysconfig.get_platform().replace("-", "_").replace(".", "_"))')
want_meta=$(printf 'Root-Is-Purelib: false\nTag: py3-none-%s\nVersion: %s\nhas-library: True\nmissing-modules: none\n' \
  "$plat" "$header_version" | sort)
if [ "$(basename "$wheel")" = "libddp-$header_version-py3-none-$plat.whl" ] && [ "$wheel_meta" = "$want_meta" ]; then
  echo "ok: the wheel is $(basename "$wheel"): py3-none-$plat, version $header_version (include/ddp.h), platlib, every module"
  pass=$((pass + 1))
else
  echo "FAILED: the wheel is $(basename "$wheel"), with"; echo "$wheel_meta"
  echo "  want libddp-$header_version-py3-none-$plat.whl, with"; echo "$want_meta"; fail=$((fail + 1))
fi
# The sources write no version of their own: pyproject.toml's is dynamic, setup.py reads the generated
# libddp/_ddp_h.py.
if grep -qE '^version *=' "$here/pyproject.toml" || grep -qE "version *= *['\"][0-9]" "$here/setup.py" "$here"/libddp/*.py "$here"/libddp/*/*.py; then
  echo "FAILED: a version is written in bindings/python (pyproject.toml, setup.py or libddp/)"; fail=$((fail + 1))
else
  echo "ok: bindings/python writes no version: it is include/ddp.h's, generated into libddp/_ddp_h.py"; pass=$((pass + 1))
fi
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
out=$(cd /tmp && env -u LIBDDP_PATH -u PYTHONPATH -u LD_LIBRARY_PATH "$py" -c \
  'import libddp; print(libddp.version()); print(libddp.library_path)' 2>&1)
want=$(sed -nE 's/^#define DDP_VERSION_(MAJOR|MINOR|PATCH) ([0-9]+).*/\2/p' "$here/../../include/ddp.h" |
       awk '{v = v * 100 + $1} END {print v}')
if [ "$(sed -n 1p <<<"$out")" = "$want" ] && [ "$(sed -n 2p <<<"$out")" = "$site/libddp/libddp.so.0" ]; then
  echo "ok: from /tmp, import libddp gives version $want from the packaged library"; pass=$((pass + 1))
else
  echo "$out"; echo "FAILED: import from /tmp (want version $want from $site/libddp/libddp.so.0)"; fail=$((fail + 1))
fi
# The tests, from a directory outside the tree, importing the installed package.
work=$venv/run; mkdir -p "$work"
res=$(cd "$work" && env -u LIBDDP_PATH -u PYTHONPATH LIBDDP_TEST_INSTALLED=1 "$py" "$here/tests/run.py" 2>&1 | tee /dev/stderr |
      grep -E '^python: [0-9]+ passed' | tail -n1)
p=$(grep -oE '[0-9]+ passed' <<<"$res" | grep -oE '[0-9]+'); f=$(grep -oE '[0-9]+ failed' <<<"$res" | grep -oE '[0-9]+')
s=$(grep -oE '[0-9]+ skipped' <<<"$res" | grep -oE '[0-9]+')
[ -z "$res" ] && { echo "FAILED: the tests gave no summary"; f=1; p=0; s=0; }
echo "python: $((pass + p)) passed, $((fail + f)) failed, ${s:-0} skipped"
[ $((fail + f)) -eq 0 ]
