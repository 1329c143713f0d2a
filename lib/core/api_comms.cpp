// The C ABI shell of the communicators: each way to make one (MPI, self, local groups, NCCL, Gloo,
// a joiner's), what it knows of itself, and its destruction. Argument checks sit beside each entry.
#include "core/comms.hpp"
#include "core/launcher.hpp"
#include "core/shell.hpp"

using namespace ddp;
using namespace ddp::shell;

extern "C" {

ddp_status_t ddp_comm_init_mpi(const void* mpi_comm, ddp_comm_t* out) {
  return guard(__func__, [&] {
    need(out, "comm");
    *out = wrap(make_mpi_comm(mpi_comm));
  });
}

ddp_status_t ddp_comm_init_self(ddp_comm_t* out) {
  return guard(__func__, [&] {
    need(out, "comm");
    *out = wrap(make_local_comm(make_local_group(1), 0));
  });
}

ddp_status_t ddp_local_group_create(int nranks, ddp_local_group_t* out) {
  return guard(__func__, [&] {
    need(out, "group");
    if (nranks < 1 || nranks > 4096) fail(DDP_ERR_INVALID_ARGUMENT, "nranks is %d, it must be in 1..4096", nranks);
    ddp_local_group_t g = new ddp_local_group;
    g->impl = make_local_group(nranks);
    *out = g;
  });
}

ddp_status_t ddp_comm_init_local(ddp_local_group_t group, int rank, ddp_comm_t* out) {
  return guard(__func__, [&] {
    need(group, "group");
    need(out, "comm");
    int n = local_group_size(*group->impl);
    if (rank < 0 || rank >= n) fail(DDP_ERR_INVALID_ARGUMENT, "rank %d out of range 0..%d", rank, n - 1);
    *out = wrap(make_local_comm(group->impl, rank));
  });
}

ddp_status_t ddp_local_group_destroy(ddp_local_group_t group) {
  return guard(__func__, [&] { delete group; });
}

ddp_status_t ddp_nccl_get_unique_id(ddp_nccl_id_t* id) {
  return guard(__func__, [&] {
    need(id, "id");
    nccl_get_unique_id(id);
  });
}

namespace {
void check_init_timeout(int64_t timeout_ms) {
  if (timeout_ms < 0)
    fail(DDP_ERR_INVALID_ARGUMENT, "timeout_ms is %lld: give milliseconds, 0 to wait forever",
         static_cast<long long>(timeout_ms));
}

void init_nccl(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device, int64_t timeout_ms, ddp_comm_t* out) {
  need(id, "id");
  need(out, "comm");
  if (nranks < 1) fail(DDP_ERR_INVALID_ARGUMENT, "nranks is %d", nranks);
  if (rank < 0 || rank >= nranks) fail(DDP_ERR_INVALID_ARGUMENT, "rank %d out of range 0..%d", rank, nranks - 1);
  if (cuda_device < 0) fail(DDP_ERR_INVALID_ARGUMENT, "cuda_device is %d", cuda_device);
  check_init_timeout(timeout_ms);
  *out = wrap(make_nccl_comm(id, nranks, rank, cuda_device, timeout_ms));
}

void init_nccl_mpi(const void* mpi_comm, int cuda_device, int64_t timeout_ms, ddp_comm_t* out) {
  need(out, "comm");
  if (cuda_device < 0) fail(DDP_ERR_INVALID_ARGUMENT, "cuda_device is %d", cuda_device);
  check_init_timeout(timeout_ms);
  *out = wrap(make_nccl_comm_mpi(mpi_comm, cuda_device, timeout_ms));
}
void check_world(int rank, int size) {
  if (size == 0 || size < -1)
    fail(DDP_ERR_INVALID_ARGUMENT, "size is %d: give the number of ranks, or -1 for WORLD_SIZE", size);
  if (rank < -1) fail(DDP_ERR_INVALID_ARGUMENT, "rank is %d: give 0..size-1, or -1 for RANK", rank);
  if (size > 0 && rank >= size) fail(DDP_ERR_INVALID_ARGUMENT, "rank %d out of range 0..%d", rank, size - 1);
}

void init_gloo(const char* init_method, int rank, int size, int64_t timeout_ms, ddp_comm_t* out) {
  need(out, "comm");
  check_world(rank, size);
  check_init_timeout(timeout_ms);
  *out = wrap(make_gloo_comm(init_method, rank, size, timeout_ms));
}

void init_nccl_store(const char* init_method, int rank, int size, int cuda_device, int64_t timeout_ms,
                     ddp_comm_t* out) {
  need(out, "comm");
  check_world(rank, size);
  if (cuda_device < 0) fail(DDP_ERR_INVALID_ARGUMENT, "cuda_device is %d", cuda_device);
  check_init_timeout(timeout_ms);
  if (!have_gloo())
    fail(DDP_ERR_UNSUPPORTED,
         "ddp_comm_init_nccl_store sends the NCCL id over Gloo, and this libddp was built "
         "without Gloo (install libgloo-dev and rebuild)");
  *out = wrap(make_nccl_comm_host(make_gloo_comm(init_method, rank, size, timeout_ms), cuda_device, timeout_ms));
}
}  // namespace

ddp_status_t ddp_comm_init_gloo(const char* init_method, int rank, int size, ddp_comm_t* out) {
  return guard(__func__, [&] { init_gloo(init_method, rank, size, default_init_timeout_ms(), out); });
}

ddp_status_t ddp_comm_init_gloo_timeout(const char* init_method, int rank, int size, int64_t timeout_ms,
                                        ddp_comm_t* out) {
  return guard(__func__, [&] { init_gloo(init_method, rank, size, timeout_ms, out); });
}

ddp_status_t ddp_comm_join_gloo(const char* init_method, int64_t timeout_ms, ddp_comm_t* out) {
  return guard(__func__, [&] {
    need(out, "comm");
    check_init_timeout(timeout_ms);
    *out = wrap(make_gloo_join_comm(init_method, timeout_ms));
  });
}

ddp_status_t ddp_comm_join_nccl(const char* init_method, int cuda_device, int64_t timeout_ms, ddp_comm_t* out) {
  return guard(__func__, [&] {
    need(out, "comm");
    if (cuda_device < 0) fail(DDP_ERR_INVALID_ARGUMENT, "cuda_device is %d", cuda_device);
    check_init_timeout(timeout_ms);
    *out = wrap(make_nccl_join_comm(init_method, cuda_device, timeout_ms));  // the device first, then Gloo
  });
}

ddp_status_t ddp_comm_init_nccl_store(const char* init_method, int rank, int size, int cuda_device, ddp_comm_t* out) {
  return guard(__func__,
               [&] { init_nccl_store(init_method, rank, size, cuda_device, default_init_timeout_ms(), out); });
}

ddp_status_t ddp_comm_init_nccl_store_timeout(const char* init_method, int rank, int size, int cuda_device,
                                              int64_t timeout_ms, ddp_comm_t* out) {
  return guard(__func__, [&] { init_nccl_store(init_method, rank, size, cuda_device, timeout_ms, out); });
}

ddp_status_t ddp_comm_init_nccl(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device, ddp_comm_t* out) {
  return guard(__func__, [&] { init_nccl(id, nranks, rank, cuda_device, default_init_timeout_ms(), out); });
}

ddp_status_t ddp_comm_init_nccl_timeout(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device,
                                        int64_t timeout_ms, ddp_comm_t* out) {
  return guard(__func__, [&] { init_nccl(id, nranks, rank, cuda_device, timeout_ms, out); });
}

ddp_status_t ddp_comm_init_nccl_mpi(const void* mpi_comm, int cuda_device, ddp_comm_t* out) {
  return guard(__func__, [&] { init_nccl_mpi(mpi_comm, cuda_device, default_init_timeout_ms(), out); });
}

ddp_status_t ddp_comm_init_nccl_mpi_timeout(const void* mpi_comm, int cuda_device, int64_t timeout_ms,
                                            ddp_comm_t* out) {
  return guard(__func__, [&] { init_nccl_mpi(mpi_comm, cuda_device, timeout_ms, out); });
}

ddp_status_t ddp_comm_wrap_nccl(void* nccl_comm, ddp_comm_t* out) {
  return guard(__func__, [&] {
    need(nccl_comm, "nccl_comm");
    need(out, "comm");
    *out = wrap(wrap_nccl_comm(nccl_comm));
  });
}

// A joiner's communicator has no rank or size until its job admits it.
static void check_admitted(const Comm& k) {
  if (k.joining())
    fail(DDP_ERR_INVALID_STATE,
         "a joiner's communicator (ddp_comm_join_gloo) has no rank until the job admits it: ddp_recover reports "
         "the rank and world it joined (ddp_membership_t)");
}

ddp_status_t ddp_comm_rank(ddp_comm_t c, int* rank) {
  return guard(__func__, [&] {
    Comm& k = comm_of(c);
    need(rank, "rank");
    check_admitted(k);
    *rank = k.rank();
  });
}

ddp_status_t ddp_comm_size(ddp_comm_t c, int* size) {
  return guard(__func__, [&] {
    Comm& k = comm_of(c);
    need(size, "size");
    check_admitted(k);
    *size = k.size();
  });
}

ddp_status_t ddp_launcher_ranks(int* rank, int* size, int* local_rank) {
  return guard(__func__, [&] {
    int r = -1, n = 0, lr = -1;
    launcher_ranks(&r, &n, &lr);
    if (rank) *rank = r;
    if (size) *size = n;
    if (local_rank) *local_rank = lr;
  });
}

ddp_status_t ddp_comm_destroy(ddp_comm_t c) {
  return guard(__func__, [&] {
    if (c && c->borrowed)
      fail(DDP_ERR_INVALID_ARGUMENT,
           "a comm hook's bucket->comm belongs to its context: it is valid during the hook and is never destroyed");
    delete c;
  });
}

}  // extern "C"
