# Reliability: the API fuzzer, the fault tests under mpirun, the threaded local-group program and the
# sanitizer runs.
#   make fuzz FUZZ_SECONDS=60   libFuzzer (clang) over the API; new inputs go to $(FUZZ_BUILD)/corpus
#   make fuzz-merge             adds the inputs with new coverage to tests/fuzz/corpus
#   make test-sanitize          every suite under ASan+UBSan, the threaded suites under TSan
# Suites added to `make test`: fuzz (replays tests/fuzz/corpus), threads (local group, threads marking
# grads at once), faults (ranks that die, stall, disagree; NaN/Inf; unused grads; threads under MPI).
FUZZ_SECONDS ?= 60
FUZZ_BUILD   ?= build/fuzz
FUZZ_CXX     ?= clang++
FUZZ_ARGS    ?=
FAULT_TIMEOUT_MS ?= 2000

REL_STATIC := $(BUILD)/lib/libddp.a
REL_SHARED := $(BUILD)/lib/libddp.so.$(MAJOR)
FUZZ_REPLAY := $(BUILD)/tests/fuzz_replay
THREADS_BIN := $(BUILD)/tests/threads_local
FAULTS_BIN  := $(BUILD)/tests/faults
SAN_SUPP    := $(abspath tests/faults/lsan.supp)

# Sanitizer reports must fail the run, not scroll by. (protect_shadow_gap=0 lets ASan builds use the
# CUDA runtime.)
export ASAN_OPTIONS ?= abort_on_error=1:detect_leaks=1:protect_shadow_gap=0
export UBSAN_OPTIONS ?= halt_on_error=1:print_stacktrace=1
export LSAN_OPTIONS ?= suppressions=$(SAN_SUPP):print_suppressions=0
export TSAN_OPTIONS ?= halt_on_error=1:second_deadlock_stack=1

$(FUZZ_REPLAY): tests/fuzz/fuzz_api.cpp tests/fuzz/replay_main.cpp tests/support/exact_grads.hpp $(REL_STATIC)
	$(call say,LINK,$@)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(SAN) $(WARN) -Iinclude tests/fuzz/fuzz_api.cpp tests/fuzz/replay_main.cpp \
	  $(REL_STATIC) -o $@ $(LDFLAGS_ALL) $(LIB_LDLIBS)

$(THREADS_BIN): tests/faults/threads_local.cpp tests/support/exact_grads.hpp $(REL_STATIC)
	$(call say,LINK,$@)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(SAN) $(WARN) -Iinclude $< $(REL_STATIC) -o $@ $(LDFLAGS_ALL) $(LIB_LDLIBS)

$(FAULTS_BIN): tests/faults/faults.cpp tests/support/exact_grads.hpp $(REL_SHARED)
	$(call say,LINK,$@)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(SAN) $(WARN) -Iinclude -DOMPI_SKIP_MPICXX=1 $(MPI_CFLAGS) $< -o $@ \
	  -L$(BUILD)/lib -lddp -Wl,-rpath,$(abspath $(BUILD)/lib) $(LDFLAGS_ALL) $(MPI_LIBS)

SUITES += fuzz threads faults
.PHONY: suite-fuzz suite-threads suite-faults fuzz fuzz-build fuzz-merge test-sanitize

suite-fuzz: $(FUZZ_REPLAY)
	$(Q)timeout 600 $(FUZZ_REPLAY) tests/fuzz/corpus

suite-threads: $(THREADS_BIN)
	$(Q)timeout 300 $(THREADS_BIN)

ifeq ($(HAVE_MPI),1)
suite-faults: $(FAULTS_BIN)
	$(Q)MPIRUN="$(MPIRUN)" TIMEOUT_MS=$(FAULT_TIMEOUT_MS) tests/faults/run.sh $(FAULTS_BIN)
else
suite-faults:
	@echo "faults: skipped: built with MPI=0"
	@echo "faults: 0 passed, 0 failed, 1 skipped"
endif

# Leaving through exit() without ddp_destroy, and after a timeout with a worker still blocked, many
# times over (the faults suites run each 10 times): every run's ranks must exit without a crash, over
# MPI and over Gloo. EXIT_SOAK_RUNS=200 by default (about 15 minutes on 2 cores).
EXIT_SOAK_RUNS ?= 200
.PHONY: exit-soak
ifeq ($(HAVE_MPI),1)
exit-soak: $(FAULTS_BIN)
	$(Q)rc=0; export MPIRUN="$(MPIRUN)" TIMEOUT_MS=$(FAULT_TIMEOUT_MS) SCENARIOS="exit-no-destroy exit-timeout" \
	  EXIT_REPEAT=$(EXIT_SOAK_RUNS); \
	tests/faults/run.sh $(FAULTS_BIN) || rc=1; \
	if [ "$(HAVE_GLOO)" = 1 ]; then tests/faults/run.sh $(FAULTS_BIN) gloo || rc=1; fi; \
	exit $$rc
else
exit-soak:
	@echo "exit-soak: skipped: built with MPI=0"
endif

# libFuzzer needs clang; the library is built for it in its own tree (no MPI, no Gloo: the fuzzer uses the
# in-process communicators), instrumented for coverage, ASan and UBSan, every report fatal.
FUZZ_SAN := -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
fuzz-build:
	$(Q)$(MAKE) --no-print-directory BUILD=$(FUZZ_BUILD) CXX=$(FUZZ_CXX) CC=clang MPI=0 GLOO=0 CUDA=0 \
	  SANITIZE=address,undefined,fuzzer-no-link CXXFLAGS=-fno-sanitize-recover=all $(FUZZ_BUILD)/lib/libddp.a
	$(call say,LINK,$(FUZZ_BUILD)/fuzz_api)
	$(Q)$(FUZZ_CXX) -std=c++17 -O1 -g $(FUZZ_SAN) -Iinclude tests/fuzz/fuzz_api.cpp $(FUZZ_BUILD)/lib/libddp.a \
	  -lpthread -o $(FUZZ_BUILD)/fuzz_api

fuzz: fuzz-build
	@mkdir -p $(FUZZ_BUILD)/corpus
	$(Q)nice -n 10 $(FUZZ_BUILD)/fuzz_api -max_total_time=$(FUZZ_SECONDS) -timeout=30 -rss_limit_mb=2048 \
	  -print_final_stats=1 -artifact_prefix=$(FUZZ_BUILD)/ $(FUZZ_ARGS) $(FUZZ_BUILD)/corpus tests/fuzz/corpus

# Keeps what a fuzzing run found: adds to tests/fuzz/corpus the inputs that bring new coverage.
fuzz-merge: fuzz-build
	$(Q)nice -n 10 $(FUZZ_BUILD)/fuzz_api -merge=1 -timeout=30 -artifact_prefix=$(FUZZ_BUILD)/ \
	  tests/fuzz/corpus $(FUZZ_BUILD)/corpus

# Everything under ASan+UBSan in its own tree, then the threaded suites under TSan; a report anywhere
# fails (the runtimes abort on the first one, and the logs are searched as well).
# Suites that load the library into another language's runtime cannot take a sanitized build; the
# timeline and demo suites' example trainer is linked without $(SAN) (mk/demo.mk), so they cannot
# either. The gpusim suite builds its own trees and runs its threaded part under TSan itself. The
# build suite checks the build system (library variants, flags, pkg-config), which a sanitized build
# adds nothing to: left out too (4.5 of its 31 minutes on 2 cores), as is the figures suite (Python
# alone, no library).
SAN_SKIP ?= python rust rust-fresh julia timeline demo install gpusim build figures
# Open MPI unloads its plugins at MPI_Finalize, so what they keep until exit shows up as leaks from
# "<unknown module>" that no suppression can name: ranks under mpirun check memory errors and UB,
# not leaks. Leaks are checked by every suite without MPI (fuzz, threads, unit).
SAN_MPIRUN ?= mpirun -x ASAN_OPTIONS=abort_on_error=1:detect_leaks=0:protect_shadow_gap=0
TSAN_SUITES ?= unit threads fuzz
SAN_REPORT := ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:|WARNING: ThreadSanitizer|ERROR: ThreadSanitizer
test-sanitize:
	$(Q)rc=0; \
	echo "=== ASan+UBSan: $(filter-out $(SAN_SKIP),$(SUITES))"; \
	j=$$(case " $$MAKEFLAGS " in *jobserver*) ;; *) echo -j$$(nproc);; esac); \
	$(MAKE) --no-print-directory $$j BUILD=$(BUILD)/asan SANITIZE=address,undefined lib || rc=1; \
	MPIRUN="$(SAN_MPIRUN)" BUILD=$(BUILD)/asan tests/run_suites.sh \
	  "$(MAKE) --no-print-directory BUILD=$(BUILD)/asan SANITIZE=address,undefined" \
	  $(filter-out $(SAN_SKIP),$(SUITES)) || rc=1; \
	if grep -lE '$(SAN_REPORT)' $(BUILD)/asan/logs/*.log; then echo "test-sanitize: ASan/UBSan reports above"; rc=1; fi; \
	echo "=== TSan: $(filter $(TSAN_SUITES),$(SUITES))"; \
	$(MAKE) --no-print-directory $$j BUILD=$(BUILD)/tsan SANITIZE=thread lib || rc=1; \
	BUILD=$(BUILD)/tsan tests/run_suites.sh "$(MAKE) --no-print-directory BUILD=$(BUILD)/tsan SANITIZE=thread" \
	  $(filter $(TSAN_SUITES),$(SUITES)) || rc=1; \
	if grep -lE '$(SAN_REPORT)' $(BUILD)/tsan/logs/*.log; then echo "test-sanitize: TSan reports above"; rc=1; fi; \
	if [ $$rc -eq 0 ]; then echo "test-sanitize: every suite passed, no sanitizer reports"; \
	else echo "test-sanitize: FAILED (see above)"; fi; \
	exit $$rc
