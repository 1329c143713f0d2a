# What a trainer needs beyond the backward pass: uneven inputs (ddp_join), the 16-bit wire
# (config.compression), host collectives (ddp_allreduce_host, ddp_barrier) and comm hooks, at every
# world size of NP_LIST over MPI and, in a build with Gloo, over Gloo too.
#   make suite-features
FEATURES_BIN := $(BUILD)/tests/mpi_features

$(FEATURES_BIN): tests/mpi/mpi_features.cpp tests/support/int8_model.hpp tests/support/int8_bound.hpp tests/support/reference.hpp tests/support/mpi_harness.hpp include/ddp.h $(BUILD)/lib/libddp.so.$(MAJOR)
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(SAN) $(WARN) -Iinclude -DOMPI_SKIP_MPICXX=1 $(MPI_CFLAGS) $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib) $(LDFLAGS_ALL) $(MPI_LIBS)

SUITES += features
.PHONY: suite-features
ifeq ($(HAVE_MPI),1)
suite-features: $(FEATURES_BIN)
	$(Q)MPIRUN="$(MPIRUN)" NP_LIST="$(NP_LIST)" HAVE_GLOO=$(HAVE_GLOO) tests/mpi/features_suite.sh $(FEATURES_BIN)
else
suite-features:
	@echo "features: skipped: built with MPI=0 (no mpicxx found, or MPI=0 was given)"
	@echo "features: 0 passed, 0 failed, 1 skipped"
endif
