// The Gloo entry point of a build without Gloo: it says why it cannot work.
#include "core/comms.hpp"

namespace ddp {

std::unique_ptr<Comm> make_gloo_comm(const char*, int, int, int64_t) {
  fail(DDP_ERR_UNSUPPORTED,
       "this libddp was built without Gloo (GLOO=0, or no gloo headers found: install libgloo-dev and rebuild)");
}

std::unique_ptr<Comm> make_gloo_join_comm(const char* init_method, int64_t timeout_ms) {
  return make_gloo_comm(init_method, -1, 0, timeout_ms);
}

// Declared in backends/gloo/gloo_errors.hpp (which a stub may not include); nothing calls it here.
[[noreturn]] void rethrow_gloo_failure(int rank, int size, const std::string& what) {
  fail(DDP_ERR_UNSUPPORTED, "rank %d of %d: %s: this libddp was built without Gloo", rank, size, what.c_str());
}

bool have_gloo() { return false; }

}  // namespace ddp
