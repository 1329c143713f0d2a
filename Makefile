# libddp: the one build entry. `make help` prints the lines below that start with "##" (here and in
# mk/*.mk): every target and every knob, which the build suite checks (tests/build/run.sh).
## Usage: make [TARGET...] [KNOB=value...]   (knobs may also come from the environment)
##
## Building
##   all, lib        the library: $(BUILD)/lib/libddp.so.0 (+ links) and libddp.a; prints the one-line
##                   build summary ("libddp 0.2.0: MPI yes (Open MPI), CUDA no, NCCL no, Gloo no") when linked
##   config          that summary, what was found (MPI flags, NCCL's header) and every knob's value
##   install         ddp.h into PREFIX/include; the libraries, libddp.pc and the CMake package into LIBDIR
##   uninstall       removes exactly what install put there (give the same PREFIX, LIBDIR, DESTDIR)
##   clean           removes $(BUILD)
##   format          clang-format every tracked C/C++/CUDA source; format-check: only check (CI)
##   bindings        the bindings' low layers and versions, generated from include/ddp.h (tools/gen_bindings.py);
##                   bindings-check: only check, naming each checked-in file that differs (CI)
##   help            this text
## Testing (each suite ends with "N passed, N failed"; make test sums them)
##   test            every suite of SUITES (listed at the end): about 20 minutes on 2 cores; first
##                   tools/setup.sh installs the packages of tools/packages.txt that are missing (as
##                   root on Debian; otherwise it names the command and stops)
##   test-quick      the suites of QUICK_SUITES, a couple of minutes; the same summary line (setup too)
##   setup           only that step: the test suites' packages (tools/packages.txt)
##   test-run, test-quick-run   make test and test-quick without that step
##   suite-NAME      one suite, NAME from SUITES; suite-python-src: the Python tests on the sources
##   test-sanitize   every suite under ASan+UBSan ($(BUILD)/asan), the threaded ones under TSan ($(BUILD)/tsan)
##   test-gpusim     the gpusim suite: the CUDA backend on a simulated CUDA runtime and NCCL, no GPU needed
##   gpu-tests, gpu-bench   build the GPU test program and the flatten benchmark (CUDA builds);
##                   gpu-probe: the device check tests/gpu/run.sh runs first (names a missing GPU or driver)
##   exit-soak       the exit scenarios (no ddp_destroy; exit after a timeout), EXIT_SOAK_RUNS times
##                   each over MPI and Gloo (default 200; the faults suites run each 10 times)
##   elastic-heavy   the elastic fault scenarios (a rank SIGKILLed, the others recover), ELASTIC_SCENARIOS
##                   of them (100): the figures of docs/reliability.md
##   fuzz            libFuzzer over the API for FUZZ_SECONDS; fuzz-merge keeps new inputs in tests/fuzz/corpus;
##                   fuzz-build builds the fuzzer in FUZZ_BUILD
##   abi-asan-lib, gpusim-run, gpusim-gpu, gpusim-elastic   steps of the abi and gpusim suites
##                   (gpusim-elastic: the elastic NCCL scenarios, tests/gpusim/run_elastic.sh)
## Examples and benchmarks
##   examples        the example trainer; demo: it on DEMO_NP ranks (DEMO_ARGS: its options), with a timeline;
##                   demo-gpu: its grads in device memory over NCCL
##   bench           the benchmarks: tables on stdout, raw numbers in $(BUILD)/bench/*.json, figures in
##                   $(BUILD)/bench/figures/*.svg (WORLD_SIZES: section 10's rank counts, "1 2 4 8")
## Knobs
##   CUDA=auto|0|1   the CUDA backend: auto when nvcc is under CUDA_HOME (default /usr/local/cuda)
##   NCCL_HOME       where nccl.h and libnccl are (default CUDA_HOME, then /usr/include); NVCC: nvcc
##   CUDA_GENCODE    nvcc's -gencode flags (sm_80, sm_90 and compute_90 PTX); NVCCFLAGS: more nvcc flags
##   MPI=auto|0|1    the MPI backend: auto when MPICXX answers (Open MPI --showme, MPICH/Intel MPI -show)
##   MPICXX          the MPI compiler wrapper that says MPI's flags (default mpicxx); MPIRUN: mpirun
##   DEBUG=1         -O0; SANITIZE=address,undefined (or thread, ...) builds with those sanitizers
##   VERBOSE=1       prints every command instead of one line per file
##   BUILD           the build folder (default build); CXX, CC: the compilers; CXXFLAGS, LDFLAGS: more flags
##   PREFIX          install's prefix (default /usr/local); LIBDIR: where the libraries go (PREFIX/lib);
##                   DESTDIR: a staging root for both; PKG_CONFIG: the pkg-config that finds MPI's module
##   GLOO=auto|0|1   the Gloo communicator: auto when gloo's headers are under GLOO_HOME (default /usr)
##   HAVE_GLOO       1 when the Gloo communicator is built (set by mk/gloo.mk), 0 otherwise
##   NP_LIST         the world sizes of the multi-rank suites (default 1 2 3 4)
##   SETUP=1|0       whether make test and test-quick run tools/setup.sh first (default 1)
##   DOCTEST_CFLAGS  where doctest.h is (default -I/usr/include/doctest); CLANG_FORMAT: clang-format
##   QUICK_SUITES    the suites of make test-quick
##   DEMO_NP, DEMO_ARGS   make demo's ranks (2) and trainer options; EXAMPLE_CFLAGS: the trainer's flags
##   DEMO_COMM       how make demo starts ranks: mpi, gloo (tools/ddp_launch), local (threads of one
##                   process, needs nothing installed) or self; default the first built, else local
##   DEMO_TIMELINE   make demo's timeline (default $(BUILD)/demo/timeline.json; .rankN per rank, .merged)
##   PYTHON_BIN      the Python of the python suites (/usr/bin/python3); JULIA: julia
##   FUZZ_SECONDS    make fuzz's time (60); FUZZ_BUILD: its tree; FUZZ_CXX: clang++; FUZZ_ARGS: libFuzzer's
##   FAULT_TIMEOUT_MS  the faults suite's timeout_ms (2000)
##   ELASTIC_SCENARIOS  make elastic-heavy's scenarios (100); ELASTIC_BIN: the scenario program
##   ASAN_OPTIONS, UBSAN_OPTIONS, LSAN_OPTIONS, TSAN_OPTIONS   the sanitizers' settings for the suites
##   SAN_SKIP        suites test-sanitize leaves out; SAN_MPIRUN: its mpirun; TSAN_SUITES: those under TSan
##   GPUSIM=1        (inside the gpusim suite) builds against the simulation; GPUSIM_TSAN: its TSan tree
CUDA_HOME ?= /usr/local/cuda
CUDA      ?= auto
MPI       ?= auto
MPICXX    ?= mpicxx
DEBUG     ?= 0
SANITIZE  ?=
VERBOSE   ?= 0
PREFIX    ?= /usr/local
LIBDIR    ?= $(PREFIX)/lib
PKG_CONFIG ?= pkg-config
BUILD     ?= build
CXX       ?= g++
CC        ?= cc
NP_LIST   ?= 1 2 3 4
SETUP     ?= 1

space := $(subst ,, )
comma := ,
MAJOR := $(shell sed -n 's/^\#define DDP_VERSION_MAJOR \([0-9]*\)/\1/p' include/ddp.h)
MINOR := $(shell sed -n 's/^\#define DDP_VERSION_MINOR \([0-9]*\)/\1/p' include/ddp.h)
PATCH := $(shell sed -n 's/^\#define DDP_VERSION_PATCH \([0-9]*\)/\1/p' include/ddp.h)
VERSION := $(MAJOR).$(MINOR).$(PATCH)

ifeq ($(VERBOSE),1)
  Q :=
  say = @true
else
  Q := @
  say = @printf '  %-8s %s\n' $(1) $(2)
endif

# --- MPI: found through $(MPICXX): Open MPI answers --showme:compile and --showme:link; MPICH and
# Intel MPI answer -show with their whole compile line, whose -I/-D flags are kept for compiling and
# -L/-l/-Wl flags for linking (the compiler's name dropped). The C++ bindings' libraries are left out
# either way: the library uses the C API (OMPI_SKIP_MPICXX, MPICH_SKIP_MPICXX). ---
ifneq ($(MPI),0)
  ifeq ($(shell $(MPICXX) --showme:compile >/dev/null 2>&1 && echo 1),1)
    MPI_FLAVOR := Open MPI
    MPI_CFLAGS := $(shell $(MPICXX) --showme:compile)
    MPI_LINK   := $(shell $(MPICXX) --showme:link)
  else
    MPI_SHOW := $(subst ",,$(shell $(MPICXX) -show 2>/dev/null | sed 's/-Xlinker  *\([^ ]*\)/-Wl,\1/g'))
    ifneq ($(MPI_SHOW),)
      MPI_FLAVOR := $(if $(findstring Intel,$(shell $(MPICXX) -v 2>&1 | head -n 1)),Intel MPI,MPICH)
      MPI_CFLAGS := $(filter -I% -D% -pthread,$(wordlist 2,$(words $(MPI_SHOW)),$(MPI_SHOW)))
      MPI_LINK   := $(filter -L% -l% -Wl$(comma)% -pthread,$(wordlist 2,$(words $(MPI_SHOW)),$(MPI_SHOW)))
    endif
  endif
  MPI_LIBS := $(filter-out -lmpicxx -lmpichcxx -lmpi_cxx,$(MPI_LINK))
  # The MPI's own pkg-config module, named in the installed libddp.pc when pkg-config knows it.
  MPI_PC_NAME := $(if $(filter Open MPI,$(MPI_FLAVOR)),ompi,$(if $(filter MPICH,$(MPI_FLAVOR)),mpich,impi))
  MPI_PC := $(if $(MPI_FLAVOR),$(shell $(PKG_CONFIG) --exists $(MPI_PC_NAME) 2>/dev/null && echo $(MPI_PC_NAME)),)
endif
ifeq ($(MPI),auto)
  HAVE_MPI := $(if $(MPI_FLAVOR),1,0)
else
  HAVE_MPI := $(MPI)
endif
ifeq ($(HAVE_MPI),1)
  ifeq ($(MPI_FLAVOR),)
    $(error MPI=1, but $(MPICXX) answers neither --showme:compile (Open MPI) nor -show (MPICH, Intel MPI))
  endif
  MPIRUN     ?= mpirun
endif
# The suites start more ranks than a small machine has cores, and may run as root: Open MPI refuses
# both unless told (an mpirun of the caller's choosing that needs neither ignores these).
ifndef OMPI_MCA_rmaps_base_oversubscribe
  export OMPI_MCA_rmaps_base_oversubscribe := 1
endif
ifeq ($(shell id -u),0)
  export OMPI_ALLOW_RUN_AS_ROOT := 1
  export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
endif

# --- CUDA: found through nvcc ---
ifeq ($(CUDA),auto)
  HAVE_CUDA := $(shell test -x $(CUDA_HOME)/bin/nvcc && echo 1 || echo 0)
else
  HAVE_CUDA := $(CUDA)
endif
NVCC ?= $(CUDA_HOME)/bin/nvcc

OPT := $(if $(filter 1,$(DEBUG)),-O0 -g,-O2 -g)
SAN := $(if $(SANITIZE),-fsanitize=$(SANITIZE) -fno-omit-frame-pointer,)
WARN := -Wall -Wextra -Wshadow -Wno-unused-parameter
CXXFLAGS_ALL := -std=c++17 $(OPT) $(SAN) $(WARN) -fPIC -fvisibility=hidden -Iinclude -Ilib -I. -MMD -MP \
                -DDDP_HAVE_MPI=$(HAVE_MPI) -DOMPI_SKIP_MPICXX=1 -DMPICH_SKIP_MPICXX=1 $(CXXFLAGS)
LDFLAGS_ALL := $(SAN) $(LDFLAGS)
LIB_LDLIBS := -lpthread $(if $(filter 1,$(HAVE_MPI)),$(MPI_LIBS),)
# What a program linking libddp.a needs besides it, as the installed libddp.pc and CMake package say
# it: pkg-config modules (STATIC_REQUIRES) and -l flags (STATIC_LIBS), never an absolute path. MPI is
# its pkg-config module, or, without one, its -l flags alone (its -L/-rpath paths are its compiler
# wrapper's business: link with mpicc); mk/cuda.mk adds -lcudart -lnccl -ldl.
STATIC_REQUIRES := $(if $(filter 1,$(HAVE_MPI)),$(MPI_PC),)
STATIC_LIBS := $(if $(filter 1,$(HAVE_MPI)),$(if $(MPI_PC),,$(filter -l% -pthread,$(MPI_LIBS))),)
STATIC_LIBS_LAST := -lstdc++ -lm -lpthread

# The library: the core, the host backends, MPI (or its stub); mk/cuda.mk adds the CUDA backend (or its stub).
LIB_CXX_SRCS := $(wildcard lib/core/*.cpp) $(wildcard lib/host/*.cpp) lib/backends/local/local_comm.cpp \
                $(if $(filter 1,$(HAVE_MPI)),$(wildcard lib/backends/mpi/*.cpp),lib/backends/stubs/mpi_stub.cpp)
LIB_EXTRA_OBJS :=
SUITES :=

# Each area of the project (CUDA, bindings, demo, reliability) adds its sources, suites and targets here.
include $(sort $(wildcard mk/*.mk))

ifneq ($(CUDA_BACKEND),1)
  LIB_CXX_SRCS += lib/backends/stubs/nccl_stub.cpp
endif
LIB_OBJS := $(patsubst %.cpp,$(BUILD)/obj/%.o,$(LIB_CXX_SRCS)) $(LIB_EXTRA_OBJS)

# What the objects were compiled with: rewritten when it changes (MPI or Gloo installed since the last
# build, another knob), so that every object is rebuilt rather than mixed with ones built without them.
BUILD_FLAGS := $(strip $(CXX) $(CXXFLAGS_ALL) $(MPI_CFLAGS) $(GLOO_CFLAGS) | $(LIB_CXX_SRCS) | $(LIB_LDLIBS))
FLAGS_STAMP := $(BUILD)/flags.txt
$(shell mkdir -p $(BUILD) && { printf '%s\n' '$(BUILD_FLAGS)' | cmp -s - $(FLAGS_STAMP) || \
  printf '%s\n' '$(BUILD_FLAGS)' > $(FLAGS_STAMP); })

SONAME   := libddp.so.$(MAJOR)
SHARED   := $(BUILD)/lib/$(SONAME)
STATIC   := $(BUILD)/lib/libddp.a

# What this build has, in one line: printed when the library is linked, and by make config.
# (HAVE_GLOO comes from the Gloo communicator's make file; unset, it reads "no".)
yes_no = $(if $(filter 1,$(1)),yes,no)
CUDA_SAID := $(if $(filter 1,$(CUDA_BACKEND)),$(if $(filter 1,$(GPUSIM)),yes (simulated),yes),no)
BUILD_SUMMARY = libddp $(VERSION): MPI $(if $(filter 1,$(HAVE_MPI)),yes ($(MPI_FLAVOR)),no), CUDA $(CUDA_SAID), \
  NCCL $(CUDA_SAID), Gloo $(call yes_no,$(HAVE_GLOO))
# Every knob: each variable that Makefile or mk/*.mk sets with ?=, and those read from outside alone.
KNOBS = $(sort $(shell sed -nE 's/^[[:space:]]*(export[[:space:]]+)?([A-Z][A-Z0-9_]*)[[:space:]]*\?=.*/\2/p' \
          Makefile $(wildcard mk/*.mk)) CXXFLAGS LDFLAGS NVCCFLAGS DESTDIR GPUSIM HAVE_GLOO)

.PHONY: all lib test test-quick install clean help config
.DEFAULT_GOAL := all
all: lib
lib: $(SHARED) $(STATIC) $(BUILD)/lib/libddp.so

$(BUILD)/obj/%.o: %.cpp $(FLAGS_STAMP)
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) $(CXXFLAGS_ALL) -DDDP_BUILDING_LIBRARY $(if $(filter lib/backends/mpi/%,$<),$(MPI_CFLAGS),) -c $< -o $@

# The host element loops are memory-bound loops that GCC's -O2 leaves scalar (its cheap vectorizer
# cost model): -O3 vectorizes them for the baseline ISA, with the same results (no fast-math).
# -ffp-contract=off, after any CXXFLAGS: GCC's default for C++ fuses a * b + c into an FMA on an FMA
# target (-march=native, haswell, any aarch64), which would change the bits the GPU tests and the int8
# wire's ranks rely on (kernels/elementwise.h rounds each product and sum on its own). host_simd.o
# holds the AVX2 versions of the same loops, which must give the same bits.
$(BUILD)/obj/lib/host/host_kernels.o $(BUILD)/obj/lib/host/host_simd.o: CXXFLAGS_ALL += \
  $(if $(filter 1,$(DEBUG)),,-O3) -ffp-contract=off

$(SHARED): $(LIB_OBJS) lib/libddp.map
	@echo "$(BUILD_SUMMARY)"
	$(call say,LINK,$@)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -shared -o $@ $(LIB_OBJS) -Wl,-soname,$(SONAME) -Wl,--version-script=lib/libddp.map \
	  -Wl,--no-undefined $(LDFLAGS_ALL) $(LIB_LDLIBS)
	$(Q)ln -sf $(SONAME) $(BUILD)/lib/libddp.so

# The link name comes with the library (programs that need $(SHARED) link with -lddp).
$(BUILD)/lib/libddp.so: $(SHARED)
	$(Q)ln -sf $(SONAME) $@

$(STATIC): $(LIB_OBJS)
	$(call say,AR,$@)
	@mkdir -p $(dir $@)
	$(Q)rm -f $@ && ar rcs $@ $(LIB_OBJS)

# ---------------------------------------------------------------------------------------------
# Tests: every suite prints its own summary line; tests/run_suites.sh adds them up.
# ---------------------------------------------------------------------------------------------
DOCTEST_CFLAGS ?= -I/usr/include/doctest
UNIT_SRCS := $(wildcard tests/unit/*.cpp)
UNIT_BIN  := $(BUILD)/tests/unit_tests
MPI_TEST_BIN := $(BUILD)/tests/mpi_reduce
C99_BIN   := $(BUILD)/tests/c99_api

$(BUILD)/tests/unit/%.o: tests/unit/%.cpp $(FLAGS_STAMP)
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) $(CXXFLAGS_ALL) $(DOCTEST_CFLAGS) -Ilib -c $< -o $@

$(UNIT_BIN): $(patsubst %.cpp,$(BUILD)/%.o,$(UNIT_SRCS)) $(STATIC)
	$(call say,LINK,$@)
	$(Q)$(CXX) -o $@ $^ $(LDFLAGS_ALL) $(LIB_LDLIBS)

$(MPI_TEST_BIN): tests/mpi/mpi_reduce.cpp tests/support/reference.hpp tests/support/mpi_harness.hpp $(SHARED)
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(SAN) $(WARN) -Iinclude -DOMPI_SKIP_MPICXX=1 $(MPI_CFLAGS) $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib) $(LDFLAGS_ALL) $(MPI_LIBS)

$(C99_BIN): tests/c99/c99_api.c include/ddp.h $(SHARED)
	$(call say,CC,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CC) -std=c99 -pedantic -Wall -Wextra -Werror -Iinclude $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib) $(SAN)

SUITES += unit c99 exports layers functions install mpi

.PHONY: suite-unit suite-c99 suite-exports suite-layers suite-functions suite-install suite-mpi
suite-unit: $(UNIT_BIN)
	$(Q)$(UNIT_BIN) --no-version

suite-c99: $(C99_BIN)
	$(Q)$(C99_BIN)

suite-exports: $(SHARED)
	$(Q)CC="$(CC)" tests/check_exports.sh $(SHARED)

suite-layers:
	$(Q)tests/check_layers.sh lib

# make install, then consumers of the installed package (CMake, pkg-config).
suite-install: lib
	$(Q)CUDA_HOME=$(CUDA_HOME) tests/install/run.sh "$(MAKE) --no-print-directory BUILD=$(BUILD)" $(abspath $(BUILD))/install-test

# No function in lib/ over about 60 lines.
suite-functions:
	$(Q)$(PYTHON_BIN) tests/tools/function_lengths.py --max 60 $$(find lib -name '*.cpp' -o -name '*.hpp' | sort)

ifeq ($(HAVE_MPI),1)
suite-mpi: $(MPI_TEST_BIN)
	$(Q)MPIRUN="$(MPIRUN)" NP_LIST="$(NP_LIST)" tests/mpi/run.sh $(MPI_TEST_BIN)
else
suite-mpi:
	@echo "mpi: skipped: built with MPI=0 (no mpicxx found, or MPI=0 was given)"
	@echo "mpi: 0 passed, 0 failed, 1 skipped"
endif

# make test and test-quick first make sure the suites' packages are there (tools/setup.sh), then
# read this Makefile again (a new make), so that what was just installed is found and built with.
.PHONY: setup test-run test-quick-run
setup:
	$(Q)tools/setup.sh
test test-quick: $(if $(filter 1,$(SETUP)),setup,)
	$(Q)$(MAKE) --no-print-directory $@-run

test-run: lib
	$(Q)BUILD=$(BUILD) tests/run_suites.sh "$(MAKE) --no-print-directory BUILD=$(BUILD)" $(SUITES)

# A couple of minutes on 2 cores: the API and its misuse (unit, c99), the exports and the ABI, the
# build and the install, and the multi-rank reductions at NP_LIST.
QUICK_SUITES ?= unit c99 exports abi build install mpi
test-quick-run: lib
	$(Q)BUILD=$(BUILD) tests/run_suites.sh "$(MAKE) --no-print-directory BUILD=$(BUILD)" $(QUICK_SUITES)


# ---------------------------------------------------------------------------------------------
# make install PREFIX=... [LIBDIR=...] [DESTDIR=...]: the header under PREFIX/include; the libraries
# with their soname links, libddp.pc and the CMake package under LIBDIR (lib64, lib/<triplet>, ...),
# which lies under PREFIX: both files find the rest from where they lie. make uninstall with the same
# knobs removes exactly these files.
LIBDIR_REL := $(patsubst $(PREFIX)/%,%,$(LIBDIR))
LIBDIR_UP  := $(subst $(space),/,$(patsubst %,..,$(subst /, ,$(LIBDIR_REL))))
INSTALLED  := $(PREFIX)/include/ddp.h $(addprefix $(LIBDIR)/,libddp.so.$(VERSION) $(SONAME) libddp.so libddp.a               pkgconfig/libddp.pc cmake/libddp/libddp-config.cmake cmake/libddp/libddp-config-version.cmake)
check_libdir = $(if $(filter $(PREFIX)/%,$(LIBDIR)),,$(error LIBDIR=$(LIBDIR) does not lie under PREFIX=$(PREFIX)))
cmake_list = $(subst $(space),;,$(strip $(1)))
PKG_SUBST := -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR_REL@|$(LIBDIR_REL)|' -e 's|@VERSION@|$(VERSION)|' \
  -e 's|@REQUIRES_PRIVATE@|$(STATIC_REQUIRES)|' -e 's|@LIBS_PRIVATE@|$(strip $(STATIC_LIBS) $(STATIC_LIBS_LAST))|'
CMAKE_SUBST := -e 's|@VERSION@|$(VERSION)|g' -e 's|@MAJOR@|$(MAJOR)|g' -e 's|@MINOR@|$(MINOR)|g' \
  -e 's|@LIBDIR_UP@|$(LIBDIR_UP)|g' -e 's|@HAVE_MPI@|$(HAVE_MPI)|g' -e 's|@HAVE_CUDA@|$(if $(CUDA_BACKEND),1,0)|g' -e 's|@HAVE_GLOO@|$(if $(filter 1,$(HAVE_GLOO)),1,0)|g' \
  -e 's|@MPI_LIB_NAMES@|$(call cmake_list,$(patsubst -l%,%,$(filter -l%,$(MPI_LIBS))))|g'

.PHONY: uninstall
install: lib
	$(call check_libdir)
	$(Q)install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(LIBDIR)/cmake/libddp
	$(Q)install -m 644 include/ddp.h $(DESTDIR)$(PREFIX)/include/ddp.h
	$(Q)install -m 755 $(SHARED) $(DESTDIR)$(LIBDIR)/libddp.so.$(VERSION)
	$(Q)ln -sf libddp.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(SONAME)
	$(Q)ln -sf $(SONAME) $(DESTDIR)$(LIBDIR)/libddp.so
	$(Q)install -m 644 $(STATIC) $(DESTDIR)$(LIBDIR)/libddp.a
	$(Q)sed $(PKG_SUBST) lib/libddp.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/libddp.pc
	$(Q)for f in libddp-config libddp-config-version; do \
	  sed $(CMAKE_SUBST) lib/$$f.cmake.in > $(DESTDIR)$(LIBDIR)/cmake/libddp/$$f.cmake; done
	@echo "installed libddp $(VERSION) under $(DESTDIR)$(PREFIX) (libraries in $(DESTDIR)$(LIBDIR))"

uninstall:
	$(Q)rm -f $(addprefix $(DESTDIR),$(INSTALLED))
	$(Q)rmdir $(DESTDIR)$(LIBDIR)/cmake/libddp 2>/dev/null || true
	@echo "removed libddp $(VERSION) from $(DESTDIR)$(PREFIX) (libraries in $(DESTDIR)$(LIBDIR))"

# The house style (.clang-format) over every C, C++ and CUDA source that git tracks.
CLANG_FORMAT ?= clang-format
FORMAT_FILES = $(shell git ls-files '*.c' '*.h' '*.cpp' '*.hpp' '*.cu' 2>/dev/null | grep -v '^tests/abi/ddp_v')
.PHONY: format format-check
format:
	$(Q)$(CLANG_FORMAT) -i $(FORMAT_FILES)
format-check:
	$(Q)bad=0; for f in $(FORMAT_FILES); do \
	  $(CLANG_FORMAT) "$$f" | diff -q "$$f" - >/dev/null || { echo "format-check: $$f differs (make format)"; bad=1; }; \
	done; [ $$bad -eq 0 ] && echo "format-check: $(words $(FORMAT_FILES)) files clean"

clean:
	rm -rf $(BUILD)

config:
	$(info $(BUILD_SUMMARY))
	$(info found:)
	$(foreach v,MPI_FLAVOR MPI_CFLAGS MPI_LIBS MPI_PC HAVE_CUDA NCCL_H STATIC_REQUIRES STATIC_LIBS, \
	  $(info $(space) $(v) = $($(v))))
	$(info knobs:)
	$(foreach k,$(KNOBS),$(info $(space) $(k) = $($(k))))
	@:

help:
	@sed -n 's/^## \{0,1\}//p' Makefile $(sort $(wildcard mk/*.mk))
	@echo "Suites (make suite-NAME; make test runs them all):"
	@echo "$(SUITES)" | fold -s -w 96 | sed 's/^/  /'

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
