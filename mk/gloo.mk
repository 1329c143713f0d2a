# The Gloo communicator (lib/backends/gloo): host memory over TCP, no MPI needed. Built when Gloo's
# headers are found (GLOO=auto looks under GLOO_HOME, default /usr: Debian's libgloo-dev); GLOO=0
# turns it off, and lib/backends/stubs/gloo_stub.cpp then answers ddp_comm_init_gloo with
# DDP_ERR_UNSUPPORTED.
GLOO      ?= auto
GLOO_HOME ?= /usr
ifeq ($(GLOO),auto)
  HAVE_GLOO := $(if $(wildcard $(GLOO_HOME)/include/gloo/rendezvous/context.h),1,0)
else
  HAVE_GLOO := $(GLOO)
endif
ifeq ($(HAVE_GLOO),1)
  GLOO_CFLAGS := $(if $(filter /usr,$(GLOO_HOME)),,-isystem $(GLOO_HOME)/include)
  GLOO_LIBS   := $(if $(filter /usr,$(GLOO_HOME)),,-L$(GLOO_HOME)/lib -Wl,-rpath,$(GLOO_HOME)/lib) -lgloo
  GLOO_SRCS := $(sort $(wildcard lib/backends/gloo/*.cpp))
  LIB_CXX_SRCS += $(GLOO_SRCS)
  LIB_LDLIBS += $(GLOO_LIBS)
  STATIC_LIBS += -lgloo
$(patsubst %.cpp,$(BUILD)/obj/%.o,$(GLOO_SRCS)): CXXFLAGS_ALL += $(GLOO_CFLAGS)
else
  LIB_CXX_SRCS += lib/backends/stubs/gloo_stub.cpp
endif

# --- the gloo suite: tests/gloo/run.sh (the multi-rank tests and fault scenarios over Gloo under
# mpirun; the example trainer started by tools/ddp_launch over env:// and a file store, its losses
# against the MPI run's). (The binaries are named by path: their make files come later.)
SUITES += gloo
.PHONY: suite-gloo
GLOO_MPI_BINS := $(BUILD)/tests/mpi_reduce $(BUILD)/tests/mpi_shard $(BUILD)/tests/faults
ifneq ($(HAVE_GLOO),1)
suite-gloo:
	@echo "gloo: skipped: built without Gloo (GLOO=0, or no gloo headers under GLOO_HOME)"
	@echo "gloo: 0 passed, 0 failed, 1 skipped"
else ifeq ($(SAN),)
suite-gloo: $(DEMO_BIN) $(if $(filter 1,$(HAVE_MPI)),$(GLOO_MPI_BINS),)
	+$(Q)MPIRUN="$(MPIRUN)" tests/gloo/run.sh $(BUILD) $(DEMO_BIN) $(if $(filter 1,$(HAVE_MPI)),$(GLOO_MPI_BINS),)
else
# A sanitized build: the example trainer is linked without $(SAN) (mk/demo.mk); the rest runs.
suite-gloo: $(if $(filter 1,$(HAVE_MPI)),$(GLOO_MPI_BINS),)
	$(Q)MPIRUN="$(MPIRUN)" tests/gloo/run.sh $(BUILD) none $(if $(filter 1,$(HAVE_MPI)),$(GLOO_MPI_BINS),)
endif

# The unit tests of the Gloo communicator throw Gloo's own exceptions at the Gloo communicator's mapping.
ifeq ($(HAVE_GLOO),1)
$(BUILD)/tests/unit/test_gloo.o: CXXFLAGS_ALL += -DDDP_TEST_HAVE_GLOO=1 $(GLOO_CFLAGS)
endif

# --- the elastic suite: tests/gloo/elastic.cpp forks 3 or 4 ranks per scenario over Gloo (no MPI),
# SIGKILLs one at a random point (or stalls it), and checks the survivors' recovery; some scenarios
# meet over tools/ddp_store, so that rank 0 may die too (docs/reliability.md).
#   make elastic-heavy ELASTIC_SCENARIOS=100   the randomized run whose figures docs/reliability.md gives
ELASTIC_BIN ?= $(BUILD)/tests/elastic
ELASTIC_SCENARIOS ?= 100
SUITES += elastic
.PHONY: suite-elastic elastic-heavy
$(ELASTIC_BIN): tests/gloo/elastic.cpp tests/support/ports.hpp include/ddp.h $(BUILD)/lib/libddp.so.$(MAJOR)
	$(call say,LINK,$@)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(SAN) $(WARN) -Iinclude $< -L$(BUILD)/lib -Wl,-rpath,$(abspath $(BUILD)/lib) -lddp \
	  -lpthread -o $@
ifeq ($(HAVE_GLOO),1)
suite-elastic: $(ELASTIC_BIN) $(STORE_BIN)
	$(Q)ELASTIC_STORE_BIN=$(STORE_BIN) timeout 900 $(ELASTIC_BIN) 12
elastic-heavy: $(ELASTIC_BIN) $(STORE_BIN)
	$(Q)ELASTIC_STORE_BIN=$(STORE_BIN) $(ELASTIC_BIN) $(ELASTIC_SCENARIOS)
else
suite-elastic elastic-heavy:
	@echo "elastic: skipped: built without Gloo (GLOO=0, or no gloo headers under GLOO_HOME)"
	@echo "elastic: 0 passed, 0 failed, 1 skipped"
endif
