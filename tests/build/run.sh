#!/usr/bin/env bash
# The build itself: MPI found through the compiler wrappers of Open MPI, MPICH and Intel MPI (fake
# wrappers on PATH or in MPICXX, read back with make config); the one-line build summary, printed
# when the library is linked and not otherwise; make help naming every knob and target; the library
# built with clang++ as well.
# Usage: run.sh BUILD_DIR (run from the repository root). Ends with "build: N passed, N failed".
build=$1
pass=0; fail=0
ok() { echo "  ok   $1"; pass=$((pass + 1)); }
bad() { echo "  FAIL $1"; fail=$((fail + 1)); }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# make as a user runs it: no knob inherited from an outer make or from this environment (for the
# detection checks, which link nothing) ...
mk() { env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL -u MPI -u MPICXX -u GLOO -u HAVE_GLOO make --no-print-directory "$@"; }
# ... and with the knobs of the outer make, for what touches its build (the same library relinked).
mk_same() { make --no-print-directory "$@"; }
value() { sed -n "s/^  $1 = //p" <<<"$2"; }

# --- MPI detection ---
fake() { # fake DIR NAME: a compiler wrapper answering as the script on stdin says
  mkdir -p "$1"; { echo '#!/bin/sh'; echo "echo \"\$*\" >> '$1/calls'"; cat; } > "$1/$2"; chmod +x "$1/$2"
}
# expect_mpi NAME FLAVOR CFLAGS LIBS [ENV/ARGS...]: make config's answers with that wrapper
expect_mpi() {
  local name=$1 flavor=$2 cflags=$3 libs=$4; shift 4
  local out; out=$(mk config "$@" 2>&1)
  local got_f got_c got_l
  got_f=$(value MPI_FLAVOR "$out"); got_c=$(value MPI_CFLAGS "$out"); got_l=$(value MPI_LIBS "$out")
  if [ "$got_f" = "$flavor" ] && [ "$got_c" = "$cflags" ] && [ "$got_l" = "$libs" ] &&
     grep -q "^libddp [0-9.]*: MPI yes ($flavor)," <<<"$out"; then
    ok "$name: $flavor, MPI_CFLAGS '$cflags', MPI_LIBS '$libs'"
  else
    bad "$name: got flavor '$got_f', MPI_CFLAGS '$got_c', MPI_LIBS '$got_l' (want '$flavor', '$cflags', '$libs')"
    head -n 3 <<<"$out"
  fi
}
# MPICH: -show prints the whole line; --showme:* is passed to the compiler, which refuses it.
fake "$work/mpich" mpicxx <<'EOF'
case "$1" in
  -show) echo "g++ -I/opt/mpich/include -L/opt/mpich/lib -Wl,-rpath -Wl,/opt/mpich/lib -Wl,--enable-new-dtags -lmpi" ;;
  -v) echo "mpicxx for MPICH version 4.1.2" ;;
  *) echo "g++: error: unrecognized command-line option '$1'" >&2; exit 1 ;;
esac
EOF
PATH=$work/mpich:$PATH expect_mpi "MPICH mpicxx on PATH" MPICH "-I/opt/mpich/include" \
  "-L/opt/mpich/lib -Wl,-rpath -Wl,/opt/mpich/lib -Wl,--enable-new-dtags -lmpi"
# MPICH with its C++ bindings in the line: -lmpicxx and -lmpichcxx are left out.
fake "$work/mpich-cxx" mpicxx <<'EOF'
case "$1" in
  -show) echo "c++ -DMPICH_DEMO=1 -I/opt/mpich/include -pthread -L/opt/mpich/lib -lmpicxx -lmpichcxx -lmpi" ;;
  -v) echo "mpicxx for MPICH version 3.4" ;;
  *) exit 1 ;;
esac
EOF
PATH=$work/mpich-cxx:$PATH expect_mpi "MPICH with C++ bindings" MPICH "-DMPICH_DEMO=1 -I/opt/mpich/include -pthread" \
  "-pthread -L/opt/mpich/lib -lmpi"
# Intel MPI, named by MPICXX: quoted paths and -Xlinker pairs.
fake "$work/intel" mpiicpx <<'EOF'
case "$1" in
  -show) echo 'icpx -I"/opt/intel/mpi/include" -L"/opt/intel/mpi/lib/release" -L"/opt/intel/mpi/lib" -Xlinker --enable-new-dtags -Xlinker -rpath -Xlinker "/opt/intel/mpi/lib" -lmpicxx -lmpifort -lmpi -ldl -lrt -lpthread' ;;
  -v) echo "mpiicpx for the Intel(R) MPI Library 2021.10 for Linux*" ;;
  *) exit 1 ;;
esac
EOF
expect_mpi "Intel MPI through MPICXX=.../mpiicpx" "Intel MPI" "-I/opt/intel/mpi/include" \
  "-L/opt/intel/mpi/lib/release -L/opt/intel/mpi/lib -Wl,--enable-new-dtags -Wl,-rpath -Wl,/opt/intel/mpi/lib -lmpifort -lmpi -ldl -lrt -lpthread" \
  MPICXX="$work/intel/mpiicpx"
# Open MPI: --showme:compile and --showme:link, -lmpi_cxx left out.
fake "$work/ompi" mpicxx <<'EOF'
case "$1" in
  --showme:compile) echo "-I/opt/ompi/include -pthread" ;;
  --showme:link) echo "-pthread -L/opt/ompi/lib -lmpi_cxx -lmpi" ;;
  -show) echo "g++ -I/wrong/include -L/wrong/lib -lmpi" ;;
  *) exit 1 ;;
esac
EOF
PATH=$work/ompi:$PATH expect_mpi "Open MPI mpicxx on PATH" "Open MPI" "-I/opt/ompi/include -pthread" "-pthread -L/opt/ompi/lib -lmpi"
# No MPI: a wrapper that is not there; MPI=0: the wrapper is not even asked.
out=$(mk config MPICXX="$work/none/mpicxx" 2>&1)
if grep -q '^libddp [0-9.]*: MPI no,' <<<"$out" && [ -z "$(value MPI_LIBS "$out")" ]; then ok "no MPI wrapper: MPI no"
else bad "no MPI wrapper: $(head -n 1 <<<"$out"), MPI_LIBS '$(value MPI_LIBS "$out")'"; fi
rm -f "$work/mpich/calls"
out=$(PATH=$work/mpich:$PATH mk config MPI=0 2>&1)
if grep -q '^libddp [0-9.]*: MPI no,' <<<"$out" && [ ! -e "$work/mpich/calls" ]; then ok "MPI=0: MPI no, the wrapper not run"
else bad "MPI=0: $(head -n 1 <<<"$out"); wrapper calls: $(cat "$work/mpich/calls" 2>/dev/null)"; fi

# --- the build summary ---
summary_re='^libddp [0-9]+\.[0-9]+\.[0-9]+: MPI (yes \([A-Za-z ]+\)|no), CUDA (yes|yes \(simulated\)|no), NCCL (yes|yes \(simulated\)|no), Gloo (yes|no)$'
config=$(mk_same config BUILD="$build" 2>&1)
line=$(head -n 1 <<<"$config")
if grep -qE "$summary_re" <<<"$line"; then ok "make config starts with the summary: $line"; else bad "make config's first line: '$line'"; fi
for k in BUILD PREFIX LIBDIR MPICXX CUDA_HOME NP_LIST; do
  grep -q "^  $k = " <<<"$config" || { bad "make config does not show the knob $k"; k=missing; break; }
done
[ "$k" = missing ] || ok "make config shows the knobs' values"
if mk config GLOO=1 2>&1 | head -n 1 | grep -q ', Gloo yes$' && mk config GLOO=0 2>&1 | head -n 1 | grep -q ', Gloo no$'; then
  ok "Gloo follows GLOO (GLOO=0: no; GLOO=1: yes)"
else bad "the summary does not follow HAVE_GLOO"; fi
# Relinking the library prints the summary once; a build with nothing to do, help and format-check none.
out=$(mk_same BUILD="$build" -W lib/libddp.map lib 2>&1)
n=$(grep -cE "$summary_re" <<<"$out")
if [ "$n" -eq 1 ] && grep -qxF "$line" <<<"$out"; then ok "linking the library prints the summary once"
else echo "$out" | head -n 5; bad "linking the library printed the summary $n times"; fi
for t in lib help format-check; do
  out=$(mk_same BUILD="$build" $t 2>&1)
  if grep -qE "$summary_re" <<<"$out"; then bad "make $t printed the summary"; else ok "make $t prints no summary"; fi
done

# --- make demo without MPI: 2 ranks over Gloo through tools/ddp_launch (one process only without both) ---
out=$(mk -n demo MPI=0 GLOO=1 BUILD="$work/demo" 2>&1)
if grep -q "tools/ddp_launch -n 2 $work/demo/examples/mlp_trainer --comm gloo" <<<"$out"; then ok "make demo without MPI: 2 ranks over Gloo (tools/ddp_launch)"
else bad "make demo MPI=0 does not start 2 ranks over Gloo: $(grep -v '^ *$' <<<"$out" | head -n 3)"; fi
out=$(mk -n demo MPI=0 GLOO=0 BUILD="$work/demo" 2>&1)
if grep -q "mlp_trainer --comm local --ranks 2" <<<"$out" && grep -q "neither MPI nor Gloo" <<<"$out"; then
  ok "make demo without MPI and Gloo: 2 ranks as threads of one process (local group), and it says why"
else bad "make demo MPI=0 GLOO=0: $(head -n 3 <<<"$out")"; fi
out=$(mk -n demo DEMO_COMM=tcp BUILD="$work/demo" 2>&1)
if grep -q "DEMO_COMM=tcp: use mpi, gloo, local or self" <<<"$out"; then ok "make demo DEMO_COMM=tcp is refused, naming the choices"
else bad "make demo DEMO_COMM=tcp: $(head -n 3 <<<"$out")"; fi

# --- make help: every knob (?= in Makefile and mk/*.mk) and every target (.PHONY) ---
help=$(mk help 2>&1)
words=$(tr -c 'A-Za-z0-9_-' '\n' <<<"$help" | sort -u)
suites=$(sed -n '/^Suites/,$p' <<<"$help" | tr -s ' ' '\n')
knobs=$(sed -nE 's/^[[:space:]]*(export[[:space:]]+)?([A-Z][A-Z0-9_]*)[[:space:]]*\?=.*/\2/p' Makefile mk/*.mk | sort -u)
targets=$(sed -n 's/^\.PHONY://p' Makefile mk/*.mk | tr -s ' ' '\n' | grep -v '^$' | sort -u)
missing=""
for k in $knobs; do grep -qx "$k" <<<"$words" || missing="$missing $k"; done
if [ -z "$missing" ]; then ok "make help names all $(wc -w <<<"$knobs") knobs"
else bad "make help does not name the knobs:$missing"; fi
missing=""
for t in $targets; do
  grep -qx -- "$t" <<<"$words" && continue
  case "$t" in suite-*) grep -qx -- "${t#suite-}" <<<"$suites" && continue ;; esac
  missing="$missing $t"
done
if [ -z "$missing" ]; then ok "make help names all $(wc -w <<<"$targets") targets"
else bad "make help does not name the targets:$missing"; fi

# --- tools/setup.sh (make test's first step) against fake dpkg-query and id on PATH ---
fake=$work/fakebin; mkdir -p "$fake"
printf '#!/bin/sh\ncase "$*" in *python3-torch*) exit 1;; *) echo "install ok installed";; esac\n' >"$fake/dpkg-query"
printf '#!/bin/sh\necho 1000\n' >"$fake/id"
chmod +x "$fake/dpkg-query" "$fake/id"
out=$(PATH="$fake:$PATH" tools/setup.sh 2>&1); rc=$?
if [ $rc -eq 1 ] && [ "$(wc -l <<<"$out")" -eq 1 ] &&
   grep -qF "missing packages: python3-torch; install them with: sudo sh -c 'apt-get update && apt-get install -y --no-install-recommends python3-torch'" <<<"$out"
then ok "setup as a user: one line naming the missing package and the exact command, exit 1"
else bad "setup as a user with python3-torch missing: exit $rc: $out"; fi
out=$(PATH="$fake:$PATH" tools/setup.sh --check 2>&1); rc=$?
if [ $rc -eq 1 ] && grep -q "missing packages: python3-torch" <<<"$out"; then ok "setup --check names what is missing, exit 1"
else bad "setup --check: exit $rc: $out"; fi
printf '#!/bin/sh\necho "install ok installed"\n' >"$fake/dpkg-query"
out=$(PATH="$fake:$PATH" tools/setup.sh 2>&1); rc=$?
if [ $rc -eq 0 ] && [ -z "$out" ]; then ok "setup with every package present: silent, exit 0"
else bad "setup with every package present: exit $rc: $out"; fi
list=$(tools/setup.sh --list)
if grep -qw doctest-dev <<<"$list" && grep -qw libopenmpi-dev <<<"$list" && grep -qF "$(tools/setup.sh --list)" <(tr -s ' \n' ' ' <README.md) ; then
  ok "the README names tools/packages.txt's packages: $list"
else bad "the README does not list the packages of tools/packages.txt ($list)"; fi
# (make's database, not make -n test: -n still runs the recursive make that runs the suites)
if mk -pq help 2>/dev/null | grep -qx 'test: setup' && mk -pq help SETUP=0 2>/dev/null | grep -qx 'test:' &&
   mk -n setup 2>&1 | grep -q "tools/setup.sh"; then ok "make test runs tools/setup.sh first (SETUP=0: not)"
else bad "make test does not depend on setup, or setup does not run tools/setup.sh"; fi

# --- another compiler: the library with clang (CUDA left out: nvcc keeps its own host compiler) ---
if command -v clang++ >/dev/null 2>&1; then
  # (the plain library: a sanitized outer build passes SANITIZE down, and clang links no ASan runtime
  # into a shared library by default)
  out=$(mk -j2 BUILD="$work/clang" CXX=clang++ CC=clang CUDA=0 SETUP=0 SANITIZE= lib 2>&1); rc=$?
  if [ $rc -eq 0 ] && ! grep -qE "warning:|error:" <<<"$out"; then ok "the library builds with clang++, no warning"
  else bad "the library with clang++: exit $rc: $(grep -E "warning:|error:" <<<"$out" | head -n 5)"; fi
else
  echo "  skip the clang++ build: no clang++ on PATH"
fi

echo "build: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
