// How the Gloo communicator reports Gloo's exceptions (gloo_comm.cpp; in a build without Gloo,
// stubs/gloo_stub.cpp answers DDP_ERR_UNSUPPORTED).
#pragma once

#include <string>

namespace ddp {

// Called inside a catch block: rethrows the exception being handled as our Error. Gloo's IoException
// (a peer's connection closed, a wait timed out) is DDP_ERR_TIMEOUT; a failed check of Gloo's
// (EnforceNotMet) DDP_ERR_MISMATCH; anything else DDP_ERR_INTERNAL. The message names rank, size and
// `what` was being done.
[[noreturn]] void rethrow_gloo_failure(int rank, int size, const std::string& what);

}  // namespace ddp
