// The Gloo entry point of a build without Gloo: it says why it cannot work.
#include "core/comms.hpp"

namespace ddp {

std::unique_ptr<Comm> make_gloo_comm(const char*, int, int, int64_t) {
  fail(DDP_ERR_UNSUPPORTED,
       "this libddp was built without Gloo (GLOO=0, or no gloo headers found: install libgloo-dev and rebuild)");
}

bool have_gloo() { return false; }

}  // namespace ddp
