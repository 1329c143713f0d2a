// The C ABI shell: argument checks, status codes, the per-thread last-error text. No exception
// crosses this file: each entry point runs its body inside guard(), which turns any exception into a
// status and a message.
#include <cstring>
#include <new>
#include <string>

#include "ddp.h"
#include "handles.hpp"
#include "mpi_comm.hpp"
#include "nccl_comm.hpp"

using namespace ddp;

namespace {

thread_local std::string t_last_error;

ddp_status_t set_error(ddp_status_t status, const char* message) {
  t_last_error = message;
  return status;
}

template <class F>
ddp_status_t guard(const char* fn, F&& body) {
  try {
    body();
    return DDP_SUCCESS;
  } catch (const Error& e) {
    // Messages that do not name their call yet get the entry point's name in front.
    const char* m = e.what();
    if (std::strncmp(m, "ddp_", 4) == 0) return set_error(e.status(), m);
    return set_error(e.status(), (std::string(fn) + ": " + m).c_str());
  } catch (const std::bad_alloc&) {
    return set_error(DDP_ERR_OUT_OF_MEMORY, (std::string(fn) + ": out of host memory").c_str());
  } catch (const std::exception& e) {
    return set_error(DDP_ERR_INTERNAL, (std::string(fn) + ": internal error: " + e.what()).c_str());
  } catch (...) {
    return set_error(DDP_ERR_INTERNAL, (std::string(fn) + ": internal error (unknown exception)").c_str());
  }
}

template <class T>
void need(const T* p, const char* fn, const char* what) {
  if (!p) fail(DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, what);
}

Context& ctx(ddp_t d, const char* fn) {
  if (!d) fail(DDP_ERR_INVALID_ARGUMENT, "%s: the ddp_t handle is NULL", fn);
  return *d->impl;
}

Comm& comm(ddp_comm_t c, const char* fn) {
  if (!c) fail(DDP_ERR_INVALID_ARGUMENT, "%s: the ddp_comm_t handle is NULL", fn);
  return *c->impl;
}

ddp_comm_t wrap(std::unique_ptr<Comm> c) {
  ddp_comm_t h = new ddp_comm;
  h->impl = std::move(c);
  return h;
}

}  // namespace

extern "C" {

const char* ddp_status_string(ddp_status_t status) {
  switch (enum_value(status)) {
#define DDP_STATUS_CASE_(name, value, text) \
  case name:                                \
    return text;
    DDP_STATUS_MAP(DDP_STATUS_CASE_)
#undef DDP_STATUS_CASE_
    default:
      return "unknown status";
  }
}

const char* ddp_last_error(void) { return t_last_error.c_str(); }

int ddp_version(void) { return DDP_VERSION_CODE; }

/* ---- communicators ---- */

ddp_status_t ddp_comm_init_mpi(const void* mpi_comm, ddp_comm_t* out) {
  return guard("ddp_comm_init_mpi", [&] {
    need(out, "ddp_comm_init_mpi", "comm");
    *out = wrap(make_mpi_comm(mpi_comm));
  });
}

ddp_status_t ddp_comm_init_self(ddp_comm_t* out) {
  return guard("ddp_comm_init_self", [&] {
    need(out, "ddp_comm_init_self", "comm");
    *out = wrap(make_local_comm(make_local_group(1), 0));
  });
}

ddp_status_t ddp_local_group_create(int nranks, ddp_local_group_t* out) {
  return guard("ddp_local_group_create", [&] {
    need(out, "ddp_local_group_create", "group");
    if (nranks < 1 || nranks > 4096)
      fail(DDP_ERR_INVALID_ARGUMENT, "ddp_local_group_create: nranks is %d, it must be in 1..4096", nranks);
    ddp_local_group_t g = new ddp_local_group;
    g->impl = make_local_group(nranks);
    *out = g;
  });
}

ddp_status_t ddp_comm_init_local(ddp_local_group_t group, int rank, ddp_comm_t* out) {
  return guard("ddp_comm_init_local", [&] {
    need(group, "ddp_comm_init_local", "group");
    need(out, "ddp_comm_init_local", "comm");
    int n = local_group_size(*group->impl);
    if (rank < 0 || rank >= n)
      fail(DDP_ERR_INVALID_ARGUMENT, "ddp_comm_init_local: rank %d out of range 0..%d", rank, n - 1);
    *out = wrap(make_local_comm(group->impl, rank));
  });
}

ddp_status_t ddp_local_group_destroy(ddp_local_group_t group) {
  return guard("ddp_local_group_destroy", [&] { delete group; });
}

ddp_status_t ddp_nccl_get_unique_id(ddp_nccl_id_t* id) {
  return guard("ddp_nccl_get_unique_id", [&] {
    need(id, "ddp_nccl_get_unique_id", "id");
    nccl_get_unique_id(id);
  });
}

ddp_status_t ddp_comm_init_nccl(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device, ddp_comm_t* out) {
  return guard("ddp_comm_init_nccl", [&] {
    need(id, "ddp_comm_init_nccl", "id");
    need(out, "ddp_comm_init_nccl", "comm");
    if (nranks < 1) fail(DDP_ERR_INVALID_ARGUMENT, "ddp_comm_init_nccl: nranks is %d", nranks);
    if (rank < 0 || rank >= nranks)
      fail(DDP_ERR_INVALID_ARGUMENT, "ddp_comm_init_nccl: rank %d out of range 0..%d", rank, nranks - 1);
    if (cuda_device < 0) fail(DDP_ERR_INVALID_ARGUMENT, "ddp_comm_init_nccl: cuda_device is %d", cuda_device);
    *out = wrap(make_nccl_comm(id, nranks, rank, cuda_device));
  });
}

ddp_status_t ddp_comm_init_nccl_mpi(const void* mpi_comm, int cuda_device, ddp_comm_t* out) {
  return guard("ddp_comm_init_nccl_mpi", [&] {
    need(out, "ddp_comm_init_nccl_mpi", "comm");
    if (cuda_device < 0) fail(DDP_ERR_INVALID_ARGUMENT, "ddp_comm_init_nccl_mpi: cuda_device is %d", cuda_device);
    *out = wrap(make_nccl_comm_mpi(mpi_comm, cuda_device));
  });
}

ddp_status_t ddp_comm_wrap_nccl(void* nccl_comm, ddp_comm_t* out) {
  return guard("ddp_comm_wrap_nccl", [&] {
    need(nccl_comm, "ddp_comm_wrap_nccl", "nccl_comm");
    need(out, "ddp_comm_wrap_nccl", "comm");
    *out = wrap(wrap_nccl_comm(nccl_comm));
  });
}

ddp_status_t ddp_comm_rank(ddp_comm_t c, int* rank) {
  return guard("ddp_comm_rank", [&] {
    Comm& k = comm(c, "ddp_comm_rank");
    need(rank, "ddp_comm_rank", "rank");
    *rank = k.rank();
  });
}

ddp_status_t ddp_comm_size(ddp_comm_t c, int* size) {
  return guard("ddp_comm_size", [&] {
    Comm& k = comm(c, "ddp_comm_size");
    need(size, "ddp_comm_size", "size");
    *size = k.size();
  });
}

ddp_status_t ddp_comm_destroy(ddp_comm_t c) {
  return guard("ddp_comm_destroy", [&] { delete c; });
}

/* ---- config and context ---- */

ddp_status_t ddp_config_init(ddp_config_t* config) {
  return guard("ddp_config_init", [&] {
    need(config, "ddp_config_init", "config");
    const ddp_config_t defaults = DDP_CONFIG_INITIALIZER;
    *config = defaults;
  });
}

ddp_status_t ddp_create(ddp_comm_t c, const ddp_config_t* config, ddp_t* out) {
  return guard("ddp_create", [&] {
    Comm& k = comm(c, "ddp_create");
    need(out, "ddp_create", "ddp");
    Settings s = read_config(config, k.size(), k.memory());
    std::unique_ptr<ddp_context> h(new ddp_context);
    h->impl.reset(new Context(k, s));
    *out = h.release();
  });
}

ddp_status_t ddp_register_grad(ddp_t d, void* grad, size_t numel, ddp_dtype_t dtype, unsigned flags, int* index) {
  return guard("ddp_register_grad", [&] {
    Context& c = ctx(d, "ddp_register_grad");
    need(index, "ddp_register_grad", "index");
    const int dt = enum_value(dtype);
    if (!dtype_valid(dt))
      fail(DDP_ERR_INVALID_ARGUMENT, "ddp_register_grad: dtype %d is not a ddp_dtype_t (DDP_F16..DDP_F64)", dt);
    *index = c.register_grad(grad, numel, static_cast<Dtype>(dt), flags);
  });
}

ddp_status_t ddp_commit(ddp_t d) {
  return guard("ddp_commit", [&] { ctx(d, "ddp_commit").commit(); });
}

ddp_status_t ddp_grad_ptr(ddp_t d, int index, void** grad) {
  return guard("ddp_grad_ptr", [&] {
    Context& c = ctx(d, "ddp_grad_ptr");
    need(grad, "ddp_grad_ptr", "grad");
    *grad = c.grad_ptr(index);
  });
}

ddp_status_t ddp_set_grad_ptr(ddp_t d, int index, void* grad) {
  return guard("ddp_set_grad_ptr", [&] { ctx(d, "ddp_set_grad_ptr").set_grad_ptr(index, grad); });
}

ddp_status_t ddp_begin_backward(ddp_t d, void* stream) {
  return guard("ddp_begin_backward", [&] { ctx(d, "ddp_begin_backward").begin_backward(stream); });
}

ddp_status_t ddp_grad_ready(ddp_t d, int index) {
  return guard("ddp_grad_ready", [&] { ctx(d, "ddp_grad_ready").grad_ready(index, nullptr); });
}

ddp_status_t ddp_grad_ready_ptr(ddp_t d, int index, void* grad) {
  return guard("ddp_grad_ready_ptr", [&] { ctx(d, "ddp_grad_ready_ptr").grad_ready(index, grad); });
}

ddp_status_t ddp_finish_backward(ddp_t d, void* stream) {
  return guard("ddp_finish_backward", [&] { ctx(d, "ddp_finish_backward").finish_backward(stream); });
}

ddp_status_t ddp_set_sync(ddp_t d, int enabled) {
  return guard("ddp_set_sync", [&] { ctx(d, "ddp_set_sync").set_sync(enabled != 0); });
}

ddp_status_t ddp_reduce_all(ddp_t d, void* stream) {
  return guard("ddp_reduce_all", [&] { ctx(d, "ddp_reduce_all").reduce_all(stream); });
}

ddp_status_t ddp_broadcast(ddp_t d, void* const* buffers, const size_t* counts, const ddp_dtype_t* dtypes, int n,
                           int root, void* stream) {
  return guard("ddp_broadcast", [&] { ctx(d, "ddp_broadcast").broadcast(buffers, counts, dtypes, n, root, stream); });
}

ddp_status_t ddp_synchronize(ddp_t d) {
  return guard("ddp_synchronize", [&] { ctx(d, "ddp_synchronize").synchronize(); });
}

ddp_status_t ddp_get_stats(ddp_t d, ddp_stats_t* stats) {
  return guard("ddp_get_stats", [&] {
    Context& c = ctx(d, "ddp_get_stats");
    need(stats, "ddp_get_stats", "stats");
    if (stats->size < offsetof(ddp_stats_t, iterations) + sizeof(uint64_t))
      fail(DDP_ERR_INVALID_ARGUMENT, "ddp_get_stats: stats->size is %zu: set it to sizeof(ddp_stats_t)", stats->size);
    c.stats(stats);
  });
}

ddp_status_t ddp_get_plan(ddp_t d, int* num_buckets, int* learned) {
  return guard("ddp_get_plan", [&] {
    Context& c = ctx(d, "ddp_get_plan");
    need(num_buckets, "ddp_get_plan", "num_buckets");
    c.plan_info(num_buckets, learned);
  });
}

ddp_status_t ddp_get_bucket(ddp_t d, int bucket, ddp_bucket_info_t* info, int* grads, size_t capacity) {
  return guard("ddp_get_bucket", [&] {
    Context& c = ctx(d, "ddp_get_bucket");
    need(info, "ddp_get_bucket", "info");
    c.bucket_info(bucket, info, grads, capacity);
  });
}

ddp_status_t ddp_destroy(ddp_t d) {
  return guard("ddp_destroy", [&] { delete d; });
}

}  // extern "C"
