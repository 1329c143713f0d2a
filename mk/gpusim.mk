# The GPU backend on a simulated CUDA runtime and NCCL (tests/gpusim): no GPU, no nvcc.
#   make test-gpusim   (suite gpusim, part of make test) builds, in $(BUILD)/gpusim, the library with
#                      its CUDA backend against the simulations (the host compiler compiles the kernel
#                      bodies), then runs the GPU tests, the multi-rank reduction, shard and features
#                      suites over ddp_comm_init_nccl_mpi at NP_LIST, the example trainer's CUDA
#                      variant, and the GPU tests again under TSan ($(BUILD)/gpusim-tsan).
# Inside that build GPUSIM=1: the lines below the `else` define it.
ifneq ($(GPUSIM),1)

SUITES += gpusim
.PHONY: suite-gpusim test-gpusim
ifeq ($(HAVE_MPI),1)
suite-gpusim:
	$(Q)$(MAKE) --no-print-directory BUILD=$(BUILD)/gpusim CUDA=0 GPUSIM=1 SANITIZE= gpusim-run GPUSIM_TSAN=$(BUILD)/gpusim-tsan
else
suite-gpusim:
	@echo "gpusim: skipped: the simulated NCCL runs over MPI, and this build has none"
	@echo "gpusim: 0 passed, 0 failed, 1 skipped"
endif
test-gpusim: suite-gpusim

else

SIM_INC    := -Itests/gpusim/include
SIM_LIBDIR := $(BUILD)/lib
SIM_CUDART := $(SIM_LIBDIR)/libddpsim_cudart.so
SIM_NCCL   := $(SIM_LIBDIR)/libddpsim_nccl.so
SIM_RPATH  := -Wl,-rpath,$(abspath $(SIM_LIBDIR))
SIM_LINK   := -L$(SIM_LIBDIR) $(SIM_RPATH) -lddpsim_nccl -lddpsim_cudart
# The simulations export their API (default visibility): the backend finds NCCL's newer functions
# with dlsym, as it does in libnccl.so.2.
SIM_CXXFLAGS := -std=c++17 $(OPT) $(SAN) $(WARN) -fPIC -Iinclude -I. $(SIM_INC) $(CXXFLAGS)

CUDA_BACKEND := 1
SIM_BACKEND_SRCS := $(wildcard lib/backends/cuda/*.cpp) tests/gpusim/kernels_sim.cpp
LIB_CXX_SRCS += $(SIM_BACKEND_SRCS)
LIB_LDLIBS += $(SIM_LINK) -ldl
$(patsubst %.cpp,$(BUILD)/obj/%.o,$(SIM_BACKEND_SRCS)): CXXFLAGS_ALL += $(SIM_INC)
$(BUILD)/lib/libddp.so.$(MAJOR): $(SIM_CUDART) $(SIM_NCCL)
# nvcc contracts a * b + c into one FMA unless the code says otherwise (__fmul_rn), so the simulated
# kernels are compiled the same way: contraction on, and FMA instructions where the CPU has them (on
# x86 only with -mfma; aarch64 always has them). Element code that would round differently on a GPU
# than on the host then differs here too. DDP_ELEM_CONTRACTS: see kernels/elementwise.h.
SIM_FMA := $(if $(shell $(CXX) -march=native -dM -E -x c++ /dev/null 2>/dev/null | grep -w __FMA__),-mfma,)
$(BUILD)/obj/tests/gpusim/kernels_sim.o: CXXFLAGS_ALL += -ffp-contract=fast $(SIM_FMA) -DDDP_ELEM_CONTRACTS=1

$(SIM_CUDART): tests/gpusim/cuda_sim.cpp $(wildcard tests/gpusim/include/*.h)
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) $(SIM_CXXFLAGS) -shared -o $@ $< -Wl,-soname,libddpsim_cudart.so $(LDFLAGS_ALL) -lpthread

$(SIM_NCCL): tests/gpusim/nccl_sim.cpp $(SIM_CUDART) kernels/elementwise.h
	$(call say,CXX,$<)
	$(Q)$(CXX) $(SIM_CXXFLAGS) -DOMPI_SKIP_MPICXX=1 $(MPI_CFLAGS) -shared -o $@ $< -Wl,-soname,libddpsim_nccl.so \
	  -L$(SIM_LIBDIR) $(SIM_RPATH) -lddpsim_cudart $(LDFLAGS_ALL) $(MPI_LIBS) -lpthread

# The GPU tests, unchanged, on the simulation, and the faults only it can make.
SIM_GPU_SRCS := $(wildcard tests/gpu/test_*.cpp) tests/gpu/main.cpp tests/gpusim/test_faults.cpp
SIM_GPU_BIN  := $(BUILD)/tests/gpu_tests
$(BUILD)/tests/gpu/%.o: tests/gpu/%.cpp
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) $(CXXFLAGS_ALL) $(SIM_INC) $(DOCTEST_CFLAGS) -Ilib -c $< -o $@
$(BUILD)/tests/gpusim/%.o: tests/gpusim/%.cpp
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) $(CXXFLAGS_ALL) $(SIM_INC) $(DOCTEST_CFLAGS) -Ilib -Itests/gpu -c $< -o $@
$(SIM_GPU_BIN): $(patsubst %.cpp,$(BUILD)/%.o,$(SIM_GPU_SRCS)) $(BUILD)/lib/libddp.a $(SIM_CUDART) $(SIM_NCCL)
	$(call say,LINK,$@)
	$(Q)$(CXX) -o $@ $(filter %.o %.a,$^) $(LDFLAGS_ALL) $(LIB_LDLIBS)

# The multi-rank reduction, shard and features suites over the simulated NCCL.
SIM_MPI_BIN := $(BUILD)/tests/mpi_nccl
SIM_SHARD_BIN := $(BUILD)/tests/mpi_nccl_shard
SIM_FEATURES_BIN := $(BUILD)/tests/mpi_nccl_features
$(SIM_MPI_BIN): tests/mpi/mpi_reduce.cpp
$(SIM_SHARD_BIN): tests/mpi/mpi_shard.cpp
$(SIM_FEATURES_BIN): tests/mpi/mpi_features.cpp tests/support/int8_model.hpp tests/support/int8_bound.hpp
$(SIM_MPI_BIN) $(SIM_SHARD_BIN) $(SIM_FEATURES_BIN): tests/support/reference.hpp tests/support/mpi_harness.hpp $(BUILD)/lib/libddp.so
	$(call say,CXX,$(filter %.cpp,$^))
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(SAN) $(WARN) -Iinclude $(SIM_INC) -DDDP_TEST_NCCL=1 -DOMPI_SKIP_MPICXX=1 \
	  $(MPI_CFLAGS) $(filter %.cpp,$^) -o $@ -L$(BUILD)/lib -lddp -Wl,-rpath,$(abspath $(BUILD)/lib) $(SIM_LINK) $(LDFLAGS_ALL) \
	  $(MPI_LIBS)

# Elastic NCCL (ranks lost and joined) over the simulated NCCL: tests/gpusim/run_elastic.sh.
SIM_ELASTIC_BIN := $(BUILD)/tests/elastic_nccl
$(SIM_ELASTIC_BIN): tests/gpusim/elastic_nccl.cpp include/ddp.h $(BUILD)/lib/libddp.so
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(SAN) $(WARN) -Iinclude $(SIM_INC) -DOMPI_SKIP_MPICXX=1 $(MPI_CFLAGS) $< -o $@ \
	  -L$(BUILD)/lib -lddp -Wl,-rpath,$(abspath $(BUILD)/lib) $(SIM_LINK) $(LDFLAGS_ALL) $(MPI_LIBS)

# The example trainer's CUDA variant.
SIM_DEMO_BIN := $(BUILD)/examples/mlp_trainer_gpusim
$(SIM_DEMO_BIN): examples/mlp_trainer.c include/ddp.h $(BUILD)/lib/libddp.so
	$(call say,CC,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CC) -std=c99 -Wall -Wextra -Iinclude $(SIM_INC) -DDDP_EXAMPLE_CUDA -O2 $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib) $(SIM_LINK) -lm

# Each part prints its own "name: P passed, F failed" line; the last line sums them.
GPUSIM_TSAN ?=
.PHONY: gpusim-run gpusim-gpu gpusim-elastic
gpusim-gpu: $(SIM_GPU_BIN)
	$(Q)DDP_GPUSIM_DEVICES=2 tests/gpu/suite.sh $(SIM_GPU_BIN)
gpusim-elastic: $(SIM_ELASTIC_BIN)
	$(Q)MPIRUN="$(MPIRUN)" tests/gpusim/run_elastic.sh $(SIM_ELASTIC_BIN)
gpusim-run: $(SIM_GPU_BIN) $(SIM_MPI_BIN) $(SIM_DEMO_BIN) $(SIM_SHARD_BIN) $(SIM_FEATURES_BIN) $(SIM_ELASTIC_BIN)
	$(Q)BUILD=$(BUILD) MPIRUN="$(MPIRUN)" TSAN_BUILD="$(GPUSIM_TSAN)" MAKE_CMD="$(MAKE) --no-print-directory" \
	  SHARD_BIN=$(SIM_SHARD_BIN) FEATURES_BIN=$(SIM_FEATURES_BIN) ELASTIC_BIN=$(SIM_ELASTIC_BIN) tests/gpusim/run.sh $(SIM_GPU_BIN) $(SIM_MPI_BIN) $(SIM_DEMO_BIN)

endif
