#!/usr/bin/env bash
# make install into a fresh prefix with LIBDIR=<prefix>/lib64, then build and run consumers of it: a
# CMake project (find_package(libddp CONFIG), shared and static targets), pkg-config builds against
# the shared library and, with `pkg-config --static` flags alone, against libddp.a; the installed
# libddp.pc and CMake files hold no absolute path but the prefix; the version rule (a request for
# another minor version of 0.x is refused); make uninstall leaves no file behind. Then the same
# install with the default LIBDIR (<prefix>/lib). Usage: run.sh MAKE BUILD_DIR
# (CUDA_HOME: where a CUDA build's consumers find libcudart and libnccl, as docs/api.md says.)
make_cmd=$1; work=$2
pass=0; fail=0
ok() { echo "  ok   $1"; pass=$((pass + 1)); }
bad() { echo "  FAIL $1"; fail=$((fail + 1)); }
rm -rf "$work"; mkdir -p "$work"
here=$(cd "$(dirname "$0")" && pwd)
prefix=$work/prefix; libdir=$prefix/lib64
installed="include/ddp.h lib64/libddp.so.0 lib64/libddp.so lib64/libddp.a lib64/pkgconfig/libddp.pc
  lib64/cmake/libddp/libddp-config.cmake lib64/cmake/libddp/libddp-config-version.cmake"
if ! $make_cmd install PREFIX="$prefix" LIBDIR="$libdir" >"$work/install.log" 2>&1; then
  cat "$work/install.log"; echo "install: 0 passed, 1 failed"; exit 1
fi
missing=""; for f in $installed; do [ -e "$prefix/$f" ] || missing="$missing $f"; done
if [ -z "$missing" ] && [ ! -e "$prefix/lib" ]; then ok "install LIBDIR=<prefix>/lib64: the libraries, libddp.pc and the CMake package in lib64"
else bad "install LIBDIR=<prefix>/lib64: missing:$missing; $(ls "$prefix" | tr '\n' ' ')"; fi

# Every absolute path written in the installed package files is the prefix (the rest is relative).
foreign=""
for f in "$libdir"/pkgconfig/libddp.pc "$libdir"/cmake/libddp/libddp-config.cmake "$libdir"/cmake/libddp/libddp-config-version.cmake; do
  [ -f "$f" ] || { foreign="$foreign $(basename "$f"): missing"; continue; }
  paths=$(tr -s ' \t"=;(),' '\n' <"$f" | sed -E 's/^-(I|L|isystem)//' | grep '^/' | grep -v "^$prefix\(/\|$\)")
  [ -n "$paths" ] && foreign="$foreign $(basename "$f"): $(echo $paths)"
done
if [ -z "$foreign" ]; then ok "libddp.pc and the CMake files name no absolute path but the prefix"
else bad "absolute paths in the installed files:$foreign"; fi

if ! command -v cmake >/dev/null; then
  echo "install: cmake not found: CMake consumer skipped"
else
  # CMake on Debian does not look in <prefix>/lib64 (FIND_LIBRARY_USE_LIB64_PATHS): name the package's
  # folder, as docs/api.md tells such users to.
  cmake_find=(-DCMAKE_PREFIX_PATH="$prefix" -Dlibddp_DIR="$libdir/cmake/libddp")
  if cmake -S "$here" -B "$work/cmake" "${cmake_find[@]}" >"$work/cmake.log" 2>&1 &&
     cmake --build "$work/cmake" >>"$work/cmake.log" 2>&1; then
    ok "cmake: find_package(libddp 0.2 CONFIG) configured and built"
    for t in shared static; do
      if out=$("$work/cmake/consumer_$t" 2>&1); then ok "cmake: consumer_$t runs: $out"; else bad "consumer_$t: $out"; fi
    done
    if ldd "$work/cmake/consumer_shared" | grep -q "libddp.so.0 => $libdir/"; then
      ok "cmake: consumer_shared loads the installed $libdir/libddp.so.0"
    else bad "consumer_shared does not load $libdir/libddp.so.0"; fi
  else
    cat "$work/cmake.log"; bad "cmake consumer"
  fi
  # 0.x: another minor version is another ABI.
  sed 's/find_package(libddp 0.2 /find_package(libddp 0.1 /' "$here/CMakeLists.txt" > "$work/CMakeLists.txt"
  cp "$here/consumer.c" "$work/"
  if cmake -S "$work" -B "$work/cmake-old" "${cmake_find[@]}" >"$work/cmake-old.log" 2>&1; then
    bad "find_package(libddp 0.1) accepted 0.2"
  else ok "cmake: find_package(libddp 0.1) refuses 0.2 (0.x minors differ in ABI)"; fi
fi

if command -v pkg-config >/dev/null; then
  export PKG_CONFIG_PATH=$libdir/pkgconfig
  flags=$(pkg-config --cflags --libs libddp)
  if cc -std=c99 "$here/consumer.c" $flags -Wl,-rpath,"$libdir" -o "$work/consumer_pc" && "$work/consumer_pc" >/dev/null; then
    ok "pkg-config: built and ran with '$flags'"
  else bad "pkg-config consumer"; fi

  # A static link needs what the shared library was linked with: each library it needs (libmpi,
  # libcudart, libnccl, libstdc++, libm) named by --static, and -lpthread.
  static=$(pkg-config --static --libs libddp)
  needed=$(readelf -d "$libdir/libddp.so.0" | sed -n 's/.*(NEEDED).*\[lib\([^.]*\)\.so.*\]/\1/p' | grep -vxE 'c|gcc_s|ld-linux-x86-64')
  absent=""; for l in $needed pthread; do [[ " $static " == *" -l$l "* ]] || absent="$absent -l$l"; done
  if [ -z "$absent" ]; then ok "pkg-config --static lists -l$(echo $needed pthread | sed 's/ / -l/g')"
  else bad "pkg-config --static --libs libddp ('$static') lacks$absent"; fi
  # Linked with those flags alone (-lddp made -l:libddp.a, so the linker takes the archive).
  sflags=$(pkg-config --static --cflags --libs libddp | sed -E 's/(^| )-lddp( |$)/\1-l:libddp.a\2/')
  # A CUDA build's -lcudart and -lnccl are found where CUDA lies, as a consumer would say it.
  if grep -qE -- '-l(cudart|nccl)( |$)' <<<"$sflags"; then
    export LIBRARY_PATH=${CUDA_HOME:-/usr/local/cuda}/lib64${LIBRARY_PATH:+:$LIBRARY_PATH}
  fi
  if cc -std=c99 "$here/consumer.c" $sflags -o "$work/consumer_pc_static" >"$work/static.log" 2>&1 &&
     out=$("$work/consumer_pc_static" 2>&1); then
    if readelf -d "$work/consumer_pc_static" | grep -q 'libddp\.so'; then bad "the static consumer needs libddp.so"
    else ok "pkg-config --static: linked libddp.a with '$sflags' and ran: $out"; fi
  else cat "$work/static.log"; echo "$out"; bad "static consumer with pkg-config --static flags"; fi
fi

if $make_cmd uninstall PREFIX="$prefix" LIBDIR="$libdir" >"$work/uninstall.log" 2>&1; then
  left=$(find "$prefix" -not -type d)
  if [ -z "$left" ]; then ok "make uninstall LIBDIR=<prefix>/lib64 removed every file it installed"
  else bad "make uninstall left: $(echo $left)"; fi
else cat "$work/uninstall.log"; bad "make uninstall"; fi

# The default LIBDIR: <prefix>/lib, said so in libddp.pc.
prefix2=$work/prefix-default
if $make_cmd install PREFIX="$prefix2" >"$work/install2.log" 2>&1 && [ -e "$prefix2/lib/libddp.so.0" ] &&
   grep -qx 'libdir=${prefix}/lib' "$prefix2/lib/pkgconfig/libddp.pc" &&
   $make_cmd uninstall PREFIX="$prefix2" >>"$work/install2.log" 2>&1 && [ -z "$(find "$prefix2" -not -type d)" ]; then
  ok "install and uninstall with the default LIBDIR (<prefix>/lib)"
else cat "$work/install2.log"; bad "install/uninstall with the default LIBDIR"; fi
echo "install: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
