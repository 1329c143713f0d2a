# tools/ddp_store: a job's rendezvous store in a process of its own (tools/ddp_launch --elastic starts
# it), so that an elastic job survives losing rank 0. Built with the library (make, make lib).
STORE_BIN := $(BUILD)/bin/ddp_store
lib: $(STORE_BIN)
$(STORE_BIN): tools/ddp_store.cpp $(BUILD)/lib/libddp.a
	$(call say,LINK,$@)
	@mkdir -p $(dir $@)
	$(Q)$(CXX) -std=c++17 $(OPT) $(SAN) $(WARN) -Iinclude -Ilib $< $(BUILD)/lib/libddp.a -o $@ -lpthread
