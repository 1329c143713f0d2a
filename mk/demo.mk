# The example trainer (make demo), its timeline suite, and the benchmarks (make bench).
# (Prerequisites name $(BUILD)/lib/libddp.so: this file is read before the Makefile defines $(SHARED).)
#   make demo                 the MLP trainer on DEMO_NP ranks: over MPI; without it, over Gloo; with
#                             neither, as threads of one process (libddp's local group, nothing to install)
#   make demo-gpu             the same trainer on the NCCL path (needs CUDA, NCCL and a GPU per rank)
#   make bench                the ten benchmarks; tables on stdout, raw numbers in $(BUILD)/bench/*.json,
#                             figures (bench/figures.py, matplotlib) in $(BUILD)/bench/figures/*.svg
#   make bench-network        (root) the compressed wires over an emulated link between two network
#                             namespaces, shaped to 1 and 10 Gbit/s (bench/netns_wires.sh); also make bench's section 8
# Knobs: DEMO_NP (2), DEMO_COMM (mpi, gloo, local or self), DEMO_ARGS (extra trainer options, e.g.
# --layout copy --steps 50), DEMO_TIMELINE (the timeline's path, default $(BUILD)/demo/timeline.json).
# The demo writes a timeline: DEMO_TIMELINE with .rank<N> before its extension, one Chrome trace per
# rank (microseconds since the epoch), then merges the ranks with tools/merge_timeline.py into
# <path>.merged.json, one trace to open in ui.perfetto.dev or chrome://tracing (docs/api.md, "The timeline").
DEMO_NP   ?= 2
DEMO_ARGS ?=
DEMO_TIMELINE ?= $(BUILD)/demo/timeline.json
DEMO_MERGED = $(basename $(DEMO_TIMELINE)).merged.json
# Reassociation lets the matrix loops vectorize; not all of -ffast-math: its vectorized division and
# sqrt are approximations that the scalar remainder of a loop does not share, so Adam's update of one
# element would depend on where the arrays lie, and the ranks' parameters would drift apart.
EXAMPLE_CFLAGS ?= -O3 -march=native -fno-math-errno -fno-trapping-math -fno-signed-zeros -fassociative-math
DEMO_BIN  := $(BUILD)/examples/mlp_trainer
DEMO_GPU_BIN := $(BUILD)/examples/mlp_trainer_cuda
# mpirun refuses to run as root unless told so.
MPIRUN_ENV := $(if $(filter 0,$(shell id -u)),OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,)
RUN_NP     = $(MPIRUN_ENV) $(MPIRUN) --oversubscribe --bind-to none -np

$(DEMO_BIN): examples/mlp_trainer.c include/ddp.h $(BUILD)/lib/libddp.so
	$(call say,CC,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CC) -std=c99 -Wall -Wextra -pthread -Iinclude $(EXAMPLE_CFLAGS) $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib) -lm

$(DEMO_GPU_BIN): examples/mlp_trainer.c include/ddp.h $(BUILD)/lib/libddp.so
	$(call say,CC,$< [cuda])
	@mkdir -p $(dir $@)
	$(Q)$(CC) -std=c99 -Wall -Wextra -pthread -Iinclude -I$(CUDA_HOME)/include -DDDP_EXAMPLE_CUDA $(EXAMPLE_CFLAGS) $< -o $@ \
	  -L$(BUILD)/lib -lddp -L$(CUDA_HOME)/lib64 -lcudart -Wl,-rpath,$(abspath $(BUILD)/lib) \
	  -Wl,-rpath,$(CUDA_HOME)/lib64 -lm

.PHONY: demo demo-gpu examples
examples: $(DEMO_BIN)

# How make demo starts its ranks: mpi (mpirun), gloo (tools/ddp_launch, no MPI needed), local (threads
# of one process over libddp's local group: needs nothing installed) or self (one process, one rank).
# The default is the first this build has, local when it has neither MPI nor Gloo. (Recursive:
# HAVE_GLOO is set by mk/gloo.mk, read after this file.)
DEMO_COMM ?= $(if $(filter 1,$(HAVE_MPI)),mpi,$(if $(filter 1,$(HAVE_GLOO)),gloo,local))
DEMO_OPTS = --timeline $(DEMO_TIMELINE) $(DEMO_ARGS)
DEMO_RUN_mpi   = $(RUN_NP) $(DEMO_NP) $(DEMO_BIN) $(DEMO_OPTS)
DEMO_RUN_gloo  = tools/ddp_launch -n $(DEMO_NP) $(DEMO_BIN) --comm gloo $(DEMO_OPTS)
DEMO_RUN_local = $(DEMO_BIN) --comm local --ranks $(DEMO_NP) $(DEMO_OPTS)
DEMO_RUN_self  = $(DEMO_BIN) --comm self $(DEMO_OPTS)
DEMO_SAYS_mpi   = $(DEMO_NP) ranks over MPI (processes started by mpirun, host memory)
DEMO_SAYS_gloo  = $(DEMO_NP) ranks over Gloo (processes started by tools/ddp_launch, host memory)
DEMO_SAYS_local = $(DEMO_NP) ranks as threads of one process over libddp's local group (this build has \
  neither MPI nor Gloo; install either, e.g. make setup, for ranks as processes)
DEMO_SAYS_self  = one process with the self communicator (no data parallelism)

demo: $(DEMO_BIN)
	$(if $(DEMO_RUN_$(DEMO_COMM)),,$(error DEMO_COMM=$(DEMO_COMM): use mpi, gloo, local or self))
	@mkdir -p $(dir $(DEMO_TIMELINE))
	@echo "== make demo: $(DEMO_SAYS_$(DEMO_COMM)); a few seconds of training; DEMO_ARGS='$(DEMO_ARGS)'"
	$(Q)$(DEMO_RUN_$(DEMO_COMM))
	@if command -v python3 >/dev/null && python3 tools/merge_timeline.py -o $(DEMO_MERGED) $(DEMO_TIMELINE) >/dev/null 2>&1; \
	then echo "== timeline of every rank in one trace: $(DEMO_MERGED); open it in ui.perfetto.dev (Open trace file) or chrome://tracing"; \
	else echo "== timeline: $(DEMO_TIMELINE) with .rankN per rank; merge with tools/merge_timeline.py (needs python3)"; fi
	@if [ "$(HAVE_CUDA)" = 1 ] && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "== a GPU is present: 'make demo-gpu' runs the same trainer with its grads in device memory over NCCL"; fi

demo-gpu: $(DEMO_GPU_BIN)
	@echo "== make demo-gpu: $(DEMO_NP) ranks, grads in device memory, reduced over NCCL"
	$(Q)$(RUN_NP) $(DEMO_NP) $(DEMO_GPU_BIN) --comm nccl $(DEMO_ARGS)

# --- the demo suite: make demo as a new user runs it (ranks as threads, nothing installed needed) ---
SUITES += demo
.PHONY: suite-demo
suite-demo: $(DEMO_BIN)
	$(Q)examples/check_demo.sh "$(MAKE) --no-print-directory BUILD=$(BUILD)" $(BUILD)

# --- the timeline suite: a short demo with DDP_TIMELINE, then the trace is checked ---
SUITES += timeline
.PHONY: suite-timeline
ifeq ($(HAVE_MPI),1)
suite-timeline: $(DEMO_BIN)
	$(Q)BUILD=$(BUILD) MPIRUN="$(RUN_NP)" examples/check_timeline.sh $(DEMO_BIN)
else
suite-timeline:
	@echo "timeline: skipped: built without MPI"
	@echo "timeline: 0 passed, 0 failed, 1 skipped"
endif

# --- the benchmarks (not part of make test) ---
BENCH_BIN := $(BUILD)/bench/ddp_bench
.PHONY: bench
$(BENCH_BIN): bench/ddp_bench.cpp bench/grad_sizes.hpp include/ddp.h $(BUILD)/lib/libddp.so
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 -O2 -g $(WARN) -Iinclude -DOMPI_SKIP_MPICXX=1 $(MPI_CFLAGS) $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib) $(MPI_LIBS)

# Section 9 times the host loops themselves, which the shared library does not export: linked with
# the static library, as the unit tests are (no MPI needed).
HOST_BENCH_BIN := $(BUILD)/bench/host_loops
$(HOST_BENCH_BIN): bench/host_loops.cpp $(BUILD)/lib/libddp.a
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) $(CXXFLAGS_ALL) $< -o $@ $(BUILD)/lib/libddp.a $(LDFLAGS_ALL) $(LIB_LDLIBS)

ifeq ($(HAVE_MPI),1)
bench: $(BENCH_BIN) $(DEMO_BIN) $(HOST_BENCH_BIN)
	$(Q)MPIRUN="$(RUN_NP)" bench/run.sh $(BENCH_BIN) $(BUILD)/bench
else
bench:
	@echo "bench: needs MPI (mpicxx); this build has MPI=0"
endif

## More benchmarks
##   bench-network   (root; about 5 minutes) the example trainer over Gloo between two network namespaces
##                   joined by a veth pair shaped to 1 and 10 Gbit/s, every compressed wire: a table per
##                   rate, raw numbers in $(BUILD)/bench/network.json (bench/netns_wires.sh; NET_RATES,
##                   NET_STEPS, NET_RUNS in its environment); also section 8 of make bench
.PHONY: bench-network
# (HAVE_GLOO is set by mk/gloo.mk, read after this file: tested when the recipe runs.)
bench-network: $(DEMO_BIN)
	$(Q)if [ "$(HAVE_GLOO)" = 1 ]; then bench/netns_wires.sh $(DEMO_BIN) $(BUILD)/bench; \
	else echo "bench-network: needs the Gloo communicator (libgloo-dev); this build has GLOO=0"; fi

# --- the figures suite: bench/figures.py over recorded make bench JSON (tests/bench/fixtures) ---
SUITES += figures
.PHONY: suite-figures
suite-figures:
	$(Q)tests/bench/check_figures.sh
