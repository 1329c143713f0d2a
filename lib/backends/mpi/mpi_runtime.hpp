// MPI's life in this process, shared by every file of the MPI backend: the check of MPI's return
// codes, its initialization when the program left it to libddp, and what MPI_Finalize must first stop
// (the stall inspector's responder threads) or must not be run after (a request left posted).
#pragma once

#include <mpi.h>

#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "core/common.hpp"

namespace ddp {
namespace mpi {

// MPI's text for an error code.
std::string error_text(int code);

// One macro for every MPI return code: a failure throws DDP_ERR_MPI naming the call and MPI's text.
#define DDP_MPI_CHECK(call)                                                                          \
  do {                                                                                               \
    int ddp_mpi_rc_ = (call);                                                                        \
    if (ddp_mpi_rc_ != MPI_SUCCESS)                                                                  \
      ::ddp::fail(DDP_ERR_MPI, "%s failed: %s", #call, ::ddp::mpi::error_text(ddp_mpi_rc_).c_str()); \
  } while (0)

// Initializes MPI (MPI_THREAD_MULTIPLE) unless the program did; throws when it was finalized or
// initialized at a lower thread level.
void ensure_initialized();

// Called when a request of this process is left posted at its deadline (a collective or a
// duplication that timed out): a peer may be dead, and the library's own MPI_Finalize is then skipped.
void gave_up();

// The stall inspector's responder threads that are running (MpiProber), so that MPI_Finalize, whoever
// calls it, first stops them: a thread inside MPI_Iprobe while MPI shuts down crashes. Each entry
// stops and joins one thread; they are called under `mu`.
struct Responders {
  std::mutex mu;
  std::vector<std::function<void()>*> stops;
};
Responders& responders();

}  // namespace mpi
}  // namespace ddp
