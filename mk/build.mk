# The build suite (tests/build/run.sh): MPI found through Open MPI's, MPICH's and Intel MPI's compiler
# wrappers (fakes on PATH), the one-line build summary, and make help naming every knob and target.
SUITES += build
.PHONY: suite-build
# '+': the script runs make itself, which shares this make's jobs (run_suites.sh builds with -j).
suite-build:
	+$(Q)tests/build/run.sh $(BUILD)
