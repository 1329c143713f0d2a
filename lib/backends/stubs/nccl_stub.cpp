// The NCCL entry points of a build without CUDA: each says why it cannot work.
#include "core/comms.hpp"

namespace ddp {

[[noreturn]] static void no_cuda() {
  fail(DDP_ERR_UNSUPPORTED,
       "this libddp was built without CUDA and NCCL (CUDA=0, or nvcc was not found at build time): "
       "rebuild with CUDA=1 for device memory");
}

void nccl_get_unique_id(ddp_nccl_id_t*) { no_cuda(); }
std::unique_ptr<Comm> make_nccl_comm(const ddp_nccl_id_t*, int, int, int, int64_t) { no_cuda(); }
std::unique_ptr<Comm> make_nccl_comm_mpi(const void*, int, int64_t) { no_cuda(); }
std::unique_ptr<Comm> make_nccl_comm_host(std::unique_ptr<Comm>, int, int64_t) { no_cuda(); }
std::unique_ptr<Comm> make_nccl_join_comm(const char*, int, int64_t) { no_cuda(); }
std::unique_ptr<Comm> wrap_nccl_comm(void*) { no_cuda(); }

}  // namespace ddp
