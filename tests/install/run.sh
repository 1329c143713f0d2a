#!/usr/bin/env bash
# make install into a fresh prefix, then build and run consumers of it: a CMake project
# (find_package(libddp CONFIG), shared and static targets), a pkg-config build, and the version rule
# (a request for another minor version of 0.x is refused). Usage: run.sh MAKE BUILD_DIR
make_cmd=$1; work=$2
pass=0; fail=0
ok() { echo "  ok   $1"; pass=$((pass + 1)); }
bad() { echo "  FAIL $1"; fail=$((fail + 1)); }
rm -rf "$work"; mkdir -p "$work"
prefix=$work/prefix
if ! $make_cmd install PREFIX="$prefix" >"$work/install.log" 2>&1; then
  cat "$work/install.log"; echo "install: 0 passed, 1 failed"; exit 1
fi
here=$(cd "$(dirname "$0")" && pwd)
if ! command -v cmake >/dev/null; then
  echo "install: cmake not found: CMake consumer skipped"; skipped=1
else
  if cmake -S "$here" -B "$work/cmake" -DCMAKE_PREFIX_PATH="$prefix" >"$work/cmake.log" 2>&1 &&
     cmake --build "$work/cmake" >>"$work/cmake.log" 2>&1; then
    ok "cmake: find_package(libddp 0.2 CONFIG) configured and built"
    for t in shared static; do
      if out=$("$work/cmake/consumer_$t" 2>&1); then ok "cmake: consumer_$t runs: $out"; else bad "consumer_$t: $out"; fi
    done
    if ldd "$work/cmake/consumer_shared" | grep -q "libddp.so.0 => $prefix"; then
      ok "cmake: consumer_shared loads the installed libddp.so.0"
    else bad "consumer_shared does not load $prefix/lib/libddp.so.0"; fi
  else
    cat "$work/cmake.log"; bad "cmake consumer"
  fi
  # 0.x: another minor version is another ABI.
  sed 's/find_package(libddp 0.2 /find_package(libddp 0.1 /' "$here/CMakeLists.txt" > "$work/CMakeLists.txt"
  cp "$here/consumer.c" "$work/"
  if cmake -S "$work" -B "$work/cmake-old" -DCMAKE_PREFIX_PATH="$prefix" >"$work/cmake-old.log" 2>&1; then
    bad "find_package(libddp 0.1) accepted 0.2"
  else ok "cmake: find_package(libddp 0.1) refuses 0.2 (0.x minors differ in ABI)"; fi
fi
if command -v pkg-config >/dev/null; then
  flags=$(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags --libs libddp)
  if cc -std=c99 "$here/consumer.c" $flags -Wl,-rpath,"$prefix/lib" -o "$work/consumer_pc" && "$work/consumer_pc" >/dev/null; then
    ok "pkg-config: built and ran with '$flags'"
  else bad "pkg-config consumer"; fi
fi
echo "install: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
