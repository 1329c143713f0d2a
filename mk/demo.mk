# The example trainer (make demo), its timeline suite, and the benchmarks (make bench).
# (Prerequisites name $(BUILD)/lib/libddp.so: this file is read before the Makefile defines $(SHARED).)
#   make demo                 the MLP trainer on DEMO_NP ranks (over MPI; without it, over Gloo)
#   make demo-gpu             the same trainer on the NCCL path (needs CUDA, NCCL and a GPU per rank)
#   make bench                the seven benchmarks; tables on stdout, raw numbers in $(BUILD)/bench/*.json
# Knobs: DEMO_NP (2), DEMO_COMM (mpi, gloo or self), DEMO_ARGS (extra trainer options, e.g. --layout copy --steps 50).
# A timeline: DDP_TIMELINE=/tmp/t.json make demo writes /tmp/t.rank<N>.json per rank (Chrome trace,
# microseconds since the epoch); tools/merge_timeline.py -o /tmp/t.merged.json /tmp/t.json merges the
# ranks into one trace to open in ui.perfetto.dev or chrome://tracing (docs/api.md, "The timeline").
DEMO_NP   ?= 2
DEMO_ARGS ?=
EXAMPLE_CFLAGS ?= -O3 -march=native -ffast-math
DEMO_BIN  := $(BUILD)/examples/mlp_trainer
DEMO_GPU_BIN := $(BUILD)/examples/mlp_trainer_cuda
# mpirun refuses to run as root unless told so.
MPIRUN_ENV := $(if $(filter 0,$(shell id -u)),OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,)
RUN_NP     = $(MPIRUN_ENV) $(MPIRUN) --oversubscribe --bind-to none -np

$(DEMO_BIN): examples/mlp_trainer.c include/ddp.h $(BUILD)/lib/libddp.so
	$(call say,CC,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CC) -std=c99 -Wall -Wextra -Iinclude $(EXAMPLE_CFLAGS) $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib) -lm

$(DEMO_GPU_BIN): examples/mlp_trainer.c include/ddp.h $(BUILD)/lib/libddp.so
	$(call say,CC,$< [cuda])
	@mkdir -p $(dir $@)
	$(Q)$(CC) -std=c99 -Wall -Wextra -Iinclude -I$(CUDA_HOME)/include -DDDP_EXAMPLE_CUDA $(EXAMPLE_CFLAGS) $< -o $@ \
	  -L$(BUILD)/lib -lddp -L$(CUDA_HOME)/lib64 -lcudart -Wl,-rpath,$(abspath $(BUILD)/lib) \
	  -Wl,-rpath,$(CUDA_HOME)/lib64 -lm

.PHONY: demo demo-gpu examples
examples: $(DEMO_BIN)

# How make demo starts its ranks: mpi (mpirun), gloo (tools/ddp_launch, no MPI needed) or self (one
# process). The default is the first this build has. (Recursive: HAVE_GLOO is set by mk/gloo.mk, read
# after this file.)
DEMO_COMM ?= $(if $(filter 1,$(HAVE_MPI)),mpi,$(if $(filter 1,$(HAVE_GLOO)),gloo,self))
DEMO_RUN_mpi  = $(RUN_NP) $(DEMO_NP) $(DEMO_BIN) $(DEMO_ARGS)
DEMO_RUN_gloo = tools/ddp_launch -n $(DEMO_NP) $(DEMO_BIN) --comm gloo $(DEMO_ARGS)
DEMO_RUN_self = $(DEMO_BIN) --comm self $(DEMO_ARGS)
DEMO_SAYS_mpi  = $(DEMO_NP) ranks over MPI (host memory)
DEMO_SAYS_gloo = $(DEMO_NP) ranks over Gloo (host memory), started by tools/ddp_launch
DEMO_SAYS_self = built without MPI and Gloo, so one process with the self communicator

demo: $(DEMO_BIN)
	$(if $(DEMO_RUN_$(DEMO_COMM)),,$(error DEMO_COMM=$(DEMO_COMM): use mpi, gloo or self))
	@echo "== make demo: $(DEMO_SAYS_$(DEMO_COMM)); options: DEMO_ARGS='$(DEMO_ARGS)'$(if $(DDP_TIMELINE),; timeline: $(DDP_TIMELINE) per rank,)"
	$(Q)$(DEMO_RUN_$(DEMO_COMM))
	@if [ "$(HAVE_CUDA)" = 1 ] && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "== a GPU is present: 'make demo-gpu' runs the same trainer with its grads in device memory over NCCL"; fi

demo-gpu: $(DEMO_GPU_BIN)
	@echo "== make demo-gpu: $(DEMO_NP) ranks, grads in device memory, reduced over NCCL"
	$(Q)$(RUN_NP) $(DEMO_NP) $(DEMO_GPU_BIN) --comm nccl $(DEMO_ARGS)

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

ifeq ($(HAVE_MPI),1)
bench: $(BENCH_BIN) $(DEMO_BIN)
	$(Q)MPIRUN="$(RUN_NP)" bench/run.sh $(BENCH_BIN) $(BUILD)/bench
else
bench:
	@echo "bench: needs MPI (mpicxx); this build has MPI=0"
endif
