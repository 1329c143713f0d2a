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
  LIB_CXX_SRCS += lib/backends/gloo/gloo_comm.cpp
  LIB_LDLIBS += $(GLOO_LIBS)
  STATIC_LIBS += -lgloo
$(BUILD)/obj/lib/backends/gloo/gloo_comm.o: CXXFLAGS_ALL += $(GLOO_CFLAGS)
else
  LIB_CXX_SRCS += lib/backends/stubs/gloo_stub.cpp
endif
