// The NCCL communicator: device memory, CUDA streams. Built only with CUDA; without it every entry
// point throws DDP_ERR_UNSUPPORTED naming the cause (see nccl_stub.cpp).
#pragma once

#include <memory>

#include "backend.hpp"

namespace ddp {

// Whether this build has the CUDA backend.
bool nccl_built();
void nccl_get_unique_id(ddp_nccl_id_t* id);
std::unique_ptr<Comm> make_nccl_comm(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device);
// The id made on rank 0 of the MPI communicator (MPI_Comm*, nullptr for world) and broadcast over it.
std::unique_ptr<Comm> make_nccl_comm_mpi(const void* mpi_comm, int cuda_device);
// Borrows a ncclComm_t; never destroys it.
std::unique_ptr<Comm> wrap_nccl_comm(void* nccl_comm);

}  // namespace ddp
