# libddp: the one build entry.
#   make                 the library: build/lib/libddp.so.$(MAJOR) (+ links) and build/lib/libddp.a
#   make test            every suite, ending with one line "N passed, N failed, N skipped"
#   make demo            the example trainer on 2 ranks     make bench   the benchmarks
#   make install PREFIX=/usr/local   make format-check  (the house style, .clang-format)
# Knobs (set on the command line or in the environment):
CUDA_HOME ?= /usr/local/cuda
CUDA      ?= auto
MPI       ?= auto
DEBUG     ?= 0
SANITIZE  ?=
VERBOSE   ?= 0
PREFIX    ?= /usr/local
BUILD     ?= build
CXX       ?= g++
CC        ?= cc
NP_LIST   ?= 1 2 3 4

space := $(subst ,, )
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

# --- MPI: found through mpicxx --showme ---
ifeq ($(MPI),auto)
  HAVE_MPI := $(shell mpicxx --showme:compile >/dev/null 2>&1 && echo 1 || echo 0)
else
  HAVE_MPI := $(MPI)
endif
ifeq ($(HAVE_MPI),1)
  MPI_CFLAGS := $(shell mpicxx --showme:compile)
  MPI_LIBS   := $(filter-out -lmpi_cxx,$(shell mpicxx --showme:link))
  MPIRUN     ?= mpirun
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

# The library: the core, the host backends, MPI (or its stub); mk/cuda.mk adds the CUDA backend (or its stub).
LIB_CXX_SRCS := $(wildcard lib/core/*.cpp) $(wildcard lib/backends/host/*.cpp) lib/backends/local/local_comm.cpp \
                $(if $(filter 1,$(HAVE_MPI)),lib/backends/mpi/mpi_comm.cpp,lib/backends/stubs/mpi_stub.cpp)
LIB_EXTRA_OBJS :=
SUITES :=

# Each area of the project (CUDA, bindings, demo, reliability) adds its sources, suites and targets here.
include $(sort $(wildcard mk/*.mk))

ifneq ($(CUDA_BACKEND),1)
  LIB_CXX_SRCS += lib/backends/stubs/nccl_stub.cpp
endif
LIB_OBJS := $(patsubst %.cpp,$(BUILD)/obj/%.o,$(LIB_CXX_SRCS)) $(LIB_EXTRA_OBJS)

SONAME   := libddp.so.$(MAJOR)
SHARED   := $(BUILD)/lib/$(SONAME)
STATIC   := $(BUILD)/lib/libddp.a

.PHONY: all lib test install clean help
.DEFAULT_GOAL := all
all: lib
lib: $(SHARED) $(STATIC) $(BUILD)/lib/libddp.so

$(BUILD)/obj/%.o: %.cpp
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) $(CXXFLAGS_ALL) -DDDP_BUILDING_LIBRARY $(if $(filter lib/backends/mpi/%,$<),$(MPI_CFLAGS),) -c $< -o $@

# The host element loops are memory-bound loops that GCC's -O2 leaves scalar (its cheap vectorizer
# cost model): -O3 vectorizes them for the baseline ISA, with the same results (no fast-math).
$(BUILD)/obj/lib/backends/host/host_kernels.o: CXXFLAGS_ALL += $(if $(filter 1,$(DEBUG)),,-O3)

$(SHARED): $(LIB_OBJS) lib/libddp.map
	$(call say,LINK,$@)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -shared -o $@ $(LIB_OBJS) -Wl,-soname,$(SONAME) -Wl,--version-script=lib/libddp.map \
	  -Wl,--no-undefined $(LDFLAGS_ALL) $(LIB_LDLIBS)

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

$(BUILD)/tests/unit/%.o: tests/unit/%.cpp
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) $(CXXFLAGS_ALL) $(DOCTEST_CFLAGS) -Ilib -c $< -o $@

$(UNIT_BIN): $(patsubst %.cpp,$(BUILD)/%.o,$(UNIT_SRCS)) $(STATIC)
	$(call say,LINK,$@)
	$(Q)$(CXX) -o $@ $^ $(LDFLAGS_ALL) $(LIB_LDLIBS)

$(MPI_TEST_BIN): tests/mpi/mpi_reduce.cpp tests/mpi/reference.hpp tests/mpi/harness.hpp $(SHARED)
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
	$(Q)tests/install/run.sh "$(MAKE) --no-print-directory BUILD=$(BUILD)" $(abspath $(BUILD))/install-test

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

test: lib
	$(Q)BUILD=$(BUILD) tests/run_suites.sh "$(MAKE) --no-print-directory BUILD=$(BUILD)" $(SUITES)

# ---------------------------------------------------------------------------------------------
install: lib
	$(Q)install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig
	$(Q)install -m 644 include/ddp.h $(DESTDIR)$(PREFIX)/include/ddp.h
	$(Q)install -m 755 $(SHARED) $(DESTDIR)$(PREFIX)/lib/libddp.so.$(VERSION)
	$(Q)ln -sf libddp.so.$(VERSION) $(DESTDIR)$(PREFIX)/lib/$(SONAME)
	$(Q)ln -sf $(SONAME) $(DESTDIR)$(PREFIX)/lib/libddp.so
	$(Q)install -m 644 $(STATIC) $(DESTDIR)$(PREFIX)/lib/libddp.a
	$(Q)sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' \
	  -e 's|@LIBS_PRIVATE@|$(LIB_LDLIBS)|' lib/libddp.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/libddp.pc
	$(Q)install -d $(DESTDIR)$(PREFIX)/lib/cmake/libddp
	$(Q)for f in libddp-config libddp-config-version; do \
	  sed -e 's|@VERSION@|$(VERSION)|g' -e 's|@MAJOR@|$(MAJOR)|g' -e 's|@MINOR@|$(MINOR)|g' \
	    -e 's|@LIBS_PRIVATE_LIST@|$(subst $(space),;,$(strip $(LIB_LDLIBS)))|' lib/$$f.cmake.in \
	    > $(DESTDIR)$(PREFIX)/lib/cmake/libddp/$$f.cmake; done
	@echo "installed libddp $(VERSION) under $(DESTDIR)$(PREFIX)"

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

help:
	@sed -n '2,7p' Makefile

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
