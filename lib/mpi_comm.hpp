// The MPI communicator: host memory, Open MPI as the engine. Every collective is issued nonblocking
// and polled against its deadline, since an MPI collective cannot be cancelled.
#pragma once

#include <memory>

#include "backend.hpp"

namespace ddp {

// `mpi_comm` is an MPI_Comm* or nullptr for MPI_COMM_WORLD. Initializes MPI if needed.
// Throws DDP_ERR_UNSUPPORTED in a build without MPI.
std::unique_ptr<Comm> make_mpi_comm(const void* mpi_comm);
bool mpi_available();

}  // namespace ddp
