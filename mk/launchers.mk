# The example trainer started the way clusters start jobs, with the init method auto (docs/api.md,
# "The init method auto"). (HAVE_GLOO is set by mk/gloo.mk, read before this file.)
## Launchers
##   launchers       the example trainer over Gloo with --init auto under real launchers: srun -n 2 and
##                   srun -n 4 on a one-machine Slurm cluster that it starts and stops itself (as root,
##                   with slurm-wlm and munge; skipped, saying why, otherwise), and Open MPI's mpirun -np 3
##                   of a build without MPI; also the launchers suite of make test (a few minutes)
##   launchers-nompi the trainer and library built with MPI=0 in $(BUILD)/nompi (a step of launchers)
SUITES += launchers
.PHONY: launchers suite-launchers launchers-nompi
NOMPI_BUILD := $(BUILD)/nompi
NOMPI_TRAINER := $(NOMPI_BUILD)/examples/mlp_trainer

# The trainer and its library built again with MPI=0 (Gloo only), in a tree of their own.
launchers-nompi:
	$(Q)$(MAKE) --no-print-directory BUILD=$(NOMPI_BUILD) MPI=0 CUDA=0 examples >$(BUILD)/nompi.log 2>&1 || \
	  { tail -n 20 $(BUILD)/nompi.log; echo "launchers: the MPI=0 build failed ($(BUILD)/nompi.log)"; exit 1; }

ifneq ($(HAVE_GLOO),1)
launchers suite-launchers:
	@echo "launchers: skipped: built without Gloo (GLOO=0, or no gloo headers under GLOO_HOME)"
	@echo "launchers: 0 passed, 0 failed, 1 skipped"
else ifneq ($(SAN),)
launchers suite-launchers:
	@echo "launchers: skipped: a sanitized build (the example trainer is linked without sanitizers)"
	@echo "launchers: 0 passed, 0 failed, 1 skipped"
else
launchers suite-launchers: $(DEMO_BIN) launchers-nompi
	$(Q)MPIRUN="$(or $(MPIRUN),mpirun)" tests/launchers/run.sh $(BUILD) $(DEMO_BIN) $(NOMPI_TRAINER)
endif
