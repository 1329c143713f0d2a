# The ABI suite (tests/abi): C programs built against other headers than today's, run on today's
# library (make suite-abi; part of make test).
#   old_caller    the frozen 0.1.0 header, tests/abi/ddp_v0_1.h: two local ranks through two iterations
#   future_caller today's header with one field appended to ddp_config_t, ddp_stats_t and
#                 ddp_bucket_info_t, made at build time by tests/abi/future_header.awk
#   exact_sizes   versioned structs in heap blocks of exactly the caller's size, under ASan, on an ASan
#                 build of the library (an uninstrumented library writing past a block goes unseen)
# tests/abi/run.sh also checks that every function of the 0.1 header is still exported.
# (This file is read before the Makefile defines $(SHARED): prerequisites spell the library out.)
ABI_DIR    := $(BUILD)/tests/abi
ABI_LIB    := $(BUILD)/lib/libddp.so.$(MAJOR)
ABI_CFLAGS := -std=c99 -pedantic -Wall -Wextra -Werror -pthread
ABI_COMMA  := ,

# The ASan library: this build's own when SANITIZE has address (make test-sanitize), else the
# ASan+UBSan tree of make test-sanitize, $(BUILD)/asan, brought up to date here.
ifneq ($(filter address,$(subst $(ABI_COMMA), ,$(SANITIZE))),)
  ABI_ASAN_BUILD := $(BUILD)
else
  ABI_ASAN_BUILD := $(BUILD)/asan
endif

.PHONY: suite-abi abi-asan-lib
ifeq ($(ABI_ASAN_BUILD),$(BUILD))
abi-asan-lib: $(ABI_LIB)
else
abi-asan-lib:
	$(Q)$(MAKE) --no-print-directory BUILD=$(ABI_ASAN_BUILD) SANITIZE=address,undefined lib
endif

$(ABI_DIR)/old_caller: tests/abi/old_caller.c tests/abi/ddp_v0_1.h tests/abi/check.h $(ABI_LIB)
	$(call say,CC,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CC) $(ABI_CFLAGS) $(SAN) $< -o $@ -L$(BUILD)/lib -lddp -Wl,-rpath,$(abspath $(BUILD)/lib) -lm

$(ABI_DIR)/future/ddp.h: include/ddp.h tests/abi/future_header.awk
	$(call say,AWK,$@)
	@mkdir -p $(dir $@)
	$(Q)awk -f tests/abi/future_header.awk include/ddp.h > $@.tmp && mv $@.tmp $@

$(ABI_DIR)/future_caller: tests/abi/future_caller.c $(ABI_DIR)/future/ddp.h tests/abi/check.h $(ABI_LIB)
	$(call say,CC,$<)
	$(Q)$(CC) $(ABI_CFLAGS) $(SAN) -I$(ABI_DIR)/future $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib)

# Always relinked: abi-asan-lib is phony (the recursive make decides whether the ASan library is stale).
$(ABI_DIR)/exact_sizes: tests/abi/exact_sizes.c tests/abi/check.h include/ddp.h abi-asan-lib
	$(call say,CC,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CC) $(ABI_CFLAGS) -fsanitize=address -fno-omit-frame-pointer -Iinclude $< -o $@ \
	  -L$(ABI_ASAN_BUILD)/lib -lddp -Wl,-rpath,$(abspath $(ABI_ASAN_BUILD)/lib)

SUITES += abi
suite-abi: $(ABI_DIR)/old_caller $(ABI_DIR)/future_caller $(ABI_DIR)/exact_sizes
	$(Q)tests/abi/run.sh $(ABI_LIB) tests/abi/ddp_v0_1.h $^
