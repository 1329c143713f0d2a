// The communicators the C shell can make. The core declares them; each backend defines its own
// (lib/backends/*), and a build without MPI or CUDA links the stubs of lib/backends/stubs, which throw
// DDP_ERR_UNSUPPORTED naming the cause. So the core never includes a backend header.
#pragma once

#include <memory>

#include "core/backend.hpp"

namespace ddp {

// --- MPI (lib/backends/mpi): host memory ---
// `mpi_comm` is an MPI_Comm* or nullptr for MPI_COMM_WORLD. Initializes MPI if needed.
std::unique_ptr<Comm> make_mpi_comm(const void* mpi_comm);

// --- Gloo (lib/backends/gloo): host memory over TCP, ranks met through a rendezvous store ---
// `init_method`: "env://" (or NULL), "auto", "tcp://HOST:PORT" or "file:///DIR"; `rank`/`size` < 0 are read
// from RANK and WORLD_SIZE (with "auto", from the launcher's variables: host/launcher_env.hpp). Creation, duplicates
// and probers give up after `timeout_ms` (0: never).
std::unique_ptr<Comm> make_gloo_comm(const char* init_method, int rank, int size, int64_t timeout_ms);
// A communicator that joins a running elastic job over `init_method`'s store (Comm::join), giving up
// after `timeout_ms` (0: never).
std::unique_ptr<Comm> make_gloo_join_comm(const char* init_method, int64_t timeout_ms);
// Whether this build has Gloo (the stub says no).
bool have_gloo();

// --- in-process ranks (lib/backends/local): N threads of one process, host memory ---
class LocalGroup;  // shared by the ranks; holds one channel per duplicate
std::shared_ptr<LocalGroup> make_local_group(int nranks);
int local_group_size(const LocalGroup& g);
std::unique_ptr<Comm> make_local_comm(std::shared_ptr<LocalGroup> group, int rank);

// --- NCCL (lib/backends/cuda): device memory ---
// Creation gives up after `timeout_ms` (0: waits forever) with DDP_ERR_TIMEOUT where NCCL can create
// a communicator without blocking (2.14 and later).
void nccl_get_unique_id(ddp_nccl_id_t* id);
std::unique_ptr<Comm> make_nccl_comm(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device,
                                     int64_t timeout_ms);
// The id made on rank 0 of the MPI communicator (MPI_Comm*, nullptr for world) and broadcast over it;
// the MPI communicator stays with the NCCL one, for the stall inspector.
std::unique_ptr<Comm> make_nccl_comm_mpi(const void* mpi_comm, int cuda_device, int64_t timeout_ms);
// The id made on rank 0 of `host` (any host communicator: Gloo, MPI) and broadcast over it; `host`
// stays with the NCCL communicator, for the stall inspector.
std::unique_ptr<Comm> make_nccl_comm_host(std::unique_ptr<Comm> host, int cuda_device, int64_t timeout_ms);
// A joiner of a running elastic job whose communicators were made by make_nccl_comm_host over Gloo
// (ddp_comm_init_nccl_store): it meets the job's Gloo communicator through `init_method`'s store, then
// an NCCL communicator on `cuda_device` over it. Gives up after `timeout_ms` (0: never).
std::unique_ptr<Comm> make_nccl_join_comm(const char* init_method, int cuda_device, int64_t timeout_ms);
// Borrows a ncclComm_t; never destroys it.
std::unique_ptr<Comm> wrap_nccl_comm(void* nccl_comm);

}  // namespace ddp
