// Waiting for MPI with a deadline: the poll of one request, and the duplication of a communicator
// that every rank must join.
#include "backends/mpi/mpi_wait.hpp"

#include <sched.h>

#include <memory>

#include "backends/mpi/mpi_runtime.hpp"
#include "host/host_device.hpp"

namespace ddp {
namespace mpi {

// Yields between polls so that ranks oversubscribed on few cores still make progress.
void wait_request(MPI_Request* req, Deadline dl, const char* what) {
  for (unsigned spin = 0;; ++spin) {
    int done = 0;
    DDP_MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
    if (done) return;
    if ((spin & 63u) == 63u && dl.passed()) {
      gave_up();  // the request stays posted
      fail(DDP_ERR_TIMEOUT,
           "%s did not complete before the timeout: another rank stalled, died or "
           "issued a different collective",
           what);
    }
    sched_yield();
  }
}

// MPI_Comm_dup waits for every rank and cannot be stopped: the nonblocking MPI_Comm_idup instead.
// One left posted at the deadline completes whenever the last rank comes, into a handle kept until
// exit.
MPI_Comm idup_within(MPI_Comm base, Deadline dl, const char* why) {
  auto out = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  MPI_Request req;
  DDP_MPI_CHECK(MPI_Comm_idup(base, out.get(), &req));
  try {
    wait_request(
        &req, dl,
        format("the duplication of the MPI communicator (MPI_Comm_idup, waiting for every rank to %s)", why).c_str());
  } catch (const Error& e) {
    if (e.status() == DDP_ERR_TIMEOUT) host::keep_until_exit(out);
    throw;
  }
  return *out;
}

}  // namespace mpi
}  // namespace ddp
