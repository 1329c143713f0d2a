// Waiting for MPI with a deadline: off a stream worker, a call that may wait for a peer is issued
// nonblocking and its request polled until the deadline, since a blocking MPI call cannot be stopped.
// A request still open at the deadline stays posted (mpi::gave_up).
#pragma once

#include <mpi.h>

#include "core/common.hpp"

namespace ddp {
namespace mpi {

// Waits for `req`, driving MPI progress, until `dl`; past it throws DDP_ERR_TIMEOUT naming `what`.
void wait_request(MPI_Request* req, Deadline dl, const char* what);

// A duplicate of `base` (MPI_Comm_idup), waited for until `dl`; `why` ends the timeout's message
// ("waiting for every rank to <why>").
MPI_Comm idup_within(MPI_Comm base, Deadline dl, const char* why);

}  // namespace mpi
}  // namespace ddp
