# The CUDA backend: the CUDA device, its kernels and the NCCL communicator. Built when HAVE_CUDA=1
# (CUDA=auto finds nvcc under CUDA_HOME; CUDA=0 turns it off). Without it lib/backends/stubs/nccl_stub.cpp answers
# every NCCL entry point with DDP_ERR_UNSUPPORTED.
NCCL_HOME ?= $(CUDA_HOME)
CUDA_GENCODE ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
                -gencode arch=compute_90,code=compute_90

# NCCL's header: under NCCL_HOME, or where a distribution package puts it.
NCCL_H := $(firstword $(wildcard $(NCCL_HOME)/include/nccl.h /usr/include/nccl.h))
ifeq ($(HAVE_CUDA)$(NCCL_H),1)
  ifeq ($(CUDA),auto)
    $(info libddp: nvcc found but no nccl.h under NCCL_HOME=$(NCCL_HOME): building without the CUDA backend)
    HAVE_CUDA := 0
  else
    $(error CUDA=1, but nccl.h is not under NCCL_HOME=$(NCCL_HOME)/include nor /usr/include)
  endif
endif

ifeq ($(HAVE_CUDA),1)
CUDA_BACKEND := 1
CUDA_INC := -isystem $(CUDA_HOME)/include $(if $(filter-out $(CUDA_HOME),$(NCCL_HOME)),-isystem $(NCCL_HOME)/include,)
CUDA_LIBDIRS := $(sort $(CUDA_HOME)/lib64 $(NCCL_HOME)/lib64)
NVCCFLAGS_ALL := -std=c++17 $(if $(filter 1,$(DEBUG)),-O0 -g,-O3) $(CUDA_GENCODE) -Iinclude \
                 -Xcompiler -fPIC,-fvisibility=hidden,-Wall,-Wextra,-Wno-unused-parameter $(NVCCFLAGS)
KERNEL_SRCS := $(wildcard kernels/*.cu)
KERNEL_OBJS := $(patsubst %.cu,$(BUILD)/obj/%.o,$(KERNEL_SRCS))
LIB_EXTRA_OBJS += $(KERNEL_OBJS)
LIB_CXX_SRCS += $(wildcard lib/backends/cuda/*.cpp)
LIB_LDLIBS += $(foreach d,$(CUDA_LIBDIRS),-L$(d) -Wl,-rpath,$(d)) -lcudart -lnccl -ldl
# The installed package names the libraries alone: CUDA's folder is the consumer's (LIBRARY_PATH, -L).
STATIC_LIBS += -lcudart -lnccl -ldl

$(patsubst %.cpp,$(BUILD)/obj/%.o,$(wildcard lib/backends/cuda/*.cpp)): CXXFLAGS_ALL += $(CUDA_INC)

$(BUILD)/obj/kernels/%.o: kernels/%.cu
	$(call say,NVCC,$<)
	@mkdir -p $(dir $@)
	$(Q)$(NVCC) $(NVCCFLAGS_ALL) -MMD -MP -MF $(@:.o=.d) -c $< -o $@

# GPU tests: doctest programs that skip when no CUDA device is visible. (This file is read before
# the Makefile defines SHARED and STATIC, so prerequisites spell the library paths out.)
GPU_TEST_SRCS := $(wildcard tests/gpu/test_*.cpp) tests/gpu/main.cpp
GPU_TEST_BIN  := $(BUILD)/tests/gpu_tests
GPU_BENCH_BIN := $(BUILD)/tests/gpu_bench_flatten

$(BUILD)/tests/gpu/%.o: tests/gpu/%.cpp
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) $(CXXFLAGS_ALL) $(CUDA_INC) $(DOCTEST_CFLAGS) -Ilib -c $< -o $@

$(GPU_TEST_BIN): $(patsubst %.cpp,$(BUILD)/%.o,$(GPU_TEST_SRCS)) $(BUILD)/lib/libddp.a
	$(call say,LINK,$@)
	$(Q)$(CXX) -o $@ $^ $(LDFLAGS_ALL) $(LIB_LDLIBS)

$(GPU_BENCH_BIN): $(BUILD)/tests/gpu/bench_flatten.o $(BUILD)/lib/libddp.a
	$(call say,LINK,$@)
	$(Q)$(CXX) -o $@ $^ $(LDFLAGS_ALL) $(LIB_LDLIBS)

# Whether a usable GPU is here (tests/gpu/run.sh runs it first): not the library, only CUDA and NCCL.
GPU_PROBE_BIN := $(BUILD)/tests/gpu_check_device
$(GPU_PROBE_BIN): tests/gpu/check_device.cpp
	$(call say,CXX,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(WARN) $(CUDA_INC) $< -o $@ $(LDFLAGS_ALL) \
	  $(foreach d,$(CUDA_LIBDIRS),-L$(d) -Wl,-rpath,$(d)) -lcudart -lnccl

.PHONY: gpu-tests gpu-bench gpu-probe
gpu-tests: $(GPU_TEST_BIN)
gpu-bench: $(GPU_BENCH_BIN)
gpu-probe: $(GPU_PROBE_BIN)

# The probe must agree with the tests' own skip rule: no device exactly when every case skips.
suite-gpu: $(GPU_TEST_BIN) $(GPU_PROBE_BIN)
	$(Q)GPU_PROBE=$(GPU_PROBE_BIN) tests/gpu/suite.sh $(GPU_TEST_BIN)
else
suite-gpu:
	@echo "gpu: skipped: built without CUDA (CUDA=0, or no nvcc under CUDA_HOME=$(CUDA_HOME))"
	@echo "gpu: 0 passed, 0 failed, 1 skipped"
endif

# The NCCL entry points where no device can be used: built and run in every build. It hides every
# GPU (CUDA_VISIBLE_DEVICES=) so that it tests the same path on any machine.
NODEVICE_BIN := $(BUILD)/tests/nccl_nodevice
$(NODEVICE_BIN): tests/gpu/nccl_nodevice.c include/ddp.h $(BUILD)/lib/libddp.so.$(MAJOR)
	$(call say,CC,$<)
	@mkdir -p $(dir $@)
	$(Q)$(CC) -std=c99 -Wall -Wextra -Werror -Iinclude $< -o $@ -L$(BUILD)/lib -lddp \
	  -Wl,-rpath,$(abspath $(BUILD)/lib) $(SAN)

SUITES += gpu nccl-nodevice
.PHONY: suite-gpu suite-nccl-nodevice
suite-nccl-nodevice: $(NODEVICE_BIN)
	$(Q)CUDA_VISIBLE_DEVICES= $(NODEVICE_BIN) $(if $(filter 1,$(CUDA_BACKEND)),1,0)
