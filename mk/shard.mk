# Sharded reduction (config.shard): the multi-rank shard tests and the C training loop at every
# world size of NP_LIST, the guide's program (docs/sharded.md), compiled and run, and the example
# trainer's --shard against its unsharded run.
#   make suite-shard
SHARD_TEST_BIN := $(BUILD)/tests/mpi_shard
SHARD_TRAIN_BIN := $(BUILD)/tests/shard_train

$(SHARD_TRAIN_BIN): tests/mpi/shard_train.c include/ddp.h $(BUILD)/lib/libddp.so.$(MAJOR)
	$(call say,CC,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CC) -std=c99 $(OPT) $(SAN) -Wall -Wextra -Iinclude $(MPI_CFLAGS) $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib) $(LDFLAGS_ALL) $(MPI_LIBS) -lm

$(SHARD_TEST_BIN): tests/mpi/mpi_shard.cpp tests/support/reference.hpp tests/support/mpi_harness.hpp include/ddp.h $(BUILD)/lib/libddp.so.$(MAJOR)
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(SAN) $(WARN) -Iinclude -DOMPI_SKIP_MPICXX=1 $(MPI_CFLAGS) $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib) $(LDFLAGS_ALL) $(MPI_LIBS)

SUITES += shard
.PHONY: suite-shard
ifeq ($(HAVE_MPI),1)
# The example trainer is linked without $(SAN) (mk/demo.mk): a sanitized build leaves it out.
SHARD_TRAINER := $(if $(SAN),,$(DEMO_BIN))
suite-shard: $(SHARD_TEST_BIN) $(SHARD_TRAIN_BIN) $(SHARD_TRAINER)
	$(Q)MPIRUN="$(MPIRUN)" NP_LIST="$(NP_LIST)" GUIDE_CFLAGS="$(SAN)" tests/mpi/shard_suite.sh $(SHARD_TEST_BIN) \
	  $(SHARD_TRAIN_BIN) $(BUILD) $(SHARD_TRAINER)
else
suite-shard:
	@echo "shard: skipped: built with MPI=0 (no mpicxx found, or MPI=0 was given)"
	@echo "shard: 0 passed, 0 failed, 1 skipped"
endif
