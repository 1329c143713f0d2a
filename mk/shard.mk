# Sharded reduction (config.shard): the multi-rank shard suite at every world size of NP_LIST.
#   make suite-shard
SHARD_TEST_BIN := $(BUILD)/tests/mpi_shard

$(SHARD_TEST_BIN): tests/mpi/mpi_shard.cpp tests/mpi/reference.hpp tests/mpi/harness.hpp $(SHARED)
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(SAN) $(WARN) -Iinclude -DOMPI_SKIP_MPICXX=1 $(MPI_CFLAGS) $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib) $(LDFLAGS_ALL) $(MPI_LIBS)

SUITES += shard
.PHONY: suite-shard
ifeq ($(HAVE_MPI),1)
suite-shard: $(SHARD_TEST_BIN)
	$(Q)MPIRUN="$(MPIRUN)" NP_LIST="$(NP_LIST)" tests/mpi/run.sh $(SHARD_TEST_BIN) mpi-shard
else
suite-shard:
	@echo "shard: skipped: built with MPI=0 (no mpicxx found, or MPI=0 was given)"
	@echo "shard: 0 passed, 0 failed, 1 skipped"
endif
