# Bindings: Python (ctypes), Rust (libddp-sys + libddp), Julia (ccall). Suites: python, rust, julia.
# Each runs against $(BUILD)/lib; Python is Debian's /usr/bin/python3 (where python3-torch lives).
PYTHON_BIN ?= /usr/bin/python3
JULIA      ?= julia
BIND_MPIRUN := $(if $(filter 1,$(HAVE_MPI)),$(MPIRUN),)

SUITES += python rust rust-fresh julia
.PHONY: bindings bindings-check

# The low layers (Python _ddp_h.py, Rust generated.rs, Julia ddp_h.jl) and the packages' versions are
# generated from include/ddp.h and checked in; bindings-check fails while one differs.
bindings:
	$(Q)$(PYTHON_BIN) tools/gen_bindings.py

bindings-check:
	$(Q)$(PYTHON_BIN) tools/gen_bindings.py --check
.PHONY: suite-python suite-python-src suite-rust suite-rust-fresh suite-julia

# The installed package: a wheel in a fresh virtual environment, tested from outside the tree
# (bindings/python/run_suite.sh). suite-python-src runs the same tests on the sources.
suite-python: $(SHARED)
	$(Q)MPIRUN="$(or $(BIND_MPIRUN),mpirun-missing)" bindings/python/run_suite.sh $(PYTHON_BIN) $(abspath $(BUILD))/python

suite-python-src: $(SHARED)
	$(Q)LIBDDP_PATH=$(abspath $(SHARED)) MPIRUN="$(or $(BIND_MPIRUN),mpirun-missing)" \
	  $(PYTHON_BIN) bindings/python/tests/run.py

suite-rust: $(SHARED)
	$(Q)HAVE_GLOO=$(HAVE_GLOO) bindings/rust/run_suite.sh $(abspath $(BUILD)/lib) $(abspath $(BUILD)/rust) "$(BIND_MPIRUN)"

# A fresh tree: the Rust build builds the C library itself (bindings/rust/fresh_build.sh).
suite-rust-fresh:
	$(Q)bindings/rust/fresh_build.sh

suite-julia: $(SHARED)
	$(Q)if command -v $(JULIA) >/dev/null 2>&1; then \
	  HAVE_GLOO=$(HAVE_GLOO) LIBDDP_PATH=$(abspath $(SHARED)) MPIRUN="$(BIND_MPIRUN)" bindings/julia/run_suite.sh $(JULIA); \
	else \
	  echo "julia: skipped: $(JULIA) is not on PATH"; echo "julia: 0 passed, 0 failed, 1 skipped"; \
	fi
