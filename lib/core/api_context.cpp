// The C ABI shell of configs and contexts: ddp_create and every call on a ddp_t (registration, the
// backward pass, the collectives outside it, sharding, elastic recovery, the queries, destruction),
// plus the library-wide calls (status strings, the last error, the version, the log callback).
// Argument checks sit beside each entry; the context checks its state.
#include <cstddef>

#include "core/log.hpp"
#include "core/shell.hpp"

using namespace ddp;
using namespace ddp::shell;

namespace {

// config.stream_comms: num_streams C handles, each over the same ranks and memory as `base`.
std::vector<Comm*> resolve_stream_comms(Settings& s, const Comm& base) {
  const ddp_comm_t* handles = s.c.stream_comms;
  s.c.stream_comms = nullptr;  // the caller's array is borrowed for this call only
  std::vector<Comm*> comms;
  if (!handles) return comms;
  auto kind = [](Memory m) { return m == Memory::Host ? "host" : "device"; };
  for (int i = 0; i < s.c.num_streams; ++i) {
    if (!handles[i]) fail(DDP_ERR_INVALID_ARGUMENT, "config.stream_comms[%d] is NULL", i);
    Comm* sc = handles[i]->impl.get();
    if (sc->size() != base.size() || sc->memory() != base.memory())
      fail(DDP_ERR_INVALID_ARGUMENT,
           "config.stream_comms[%d] spans %d ranks of %s memory; the context's comm spans %d ranks of %s memory", i,
           sc->size(), kind(sc->memory()), base.size(), kind(base.memory()));
    comms.push_back(sc);
  }
  return comms;
}

}  // namespace

extern "C" {

const char* ddp_status_string(ddp_status_t status) { return status_name(enum_value(status)); }

const char* ddp_last_error(void) { return last_error().c_str(); }

int ddp_version(void) { return DDP_VERSION_CODE; }

ddp_status_t ddp_config_init_sized(ddp_config_t* config, size_t size) {
  return guard(__func__, [&] {
    need(config, "config");
    config_defaults(config, size);
  });
}

// The exported name that programs built against version 0.1 headers call: their struct is the first
// version's, so that is all it writes. (The header's ddp_config_init is a macro over the sized call.)
#undef ddp_config_init
ddp_status_t ddp_config_init(ddp_config_t* config) {
  return guard(__func__, [&] {
    need(config, "config");
    config_defaults(config, DDP_CONFIG_V1_SIZE);
  });
}

ddp_status_t ddp_create(ddp_comm_t c, const ddp_config_t* config, ddp_t* out) {
  return guard(__func__, [&] {
    Comm& k = comm_of(c);
    need(out, "ddp");
    Settings s = read_config(config);
    std::vector<Comm*> stream_comms = resolve_stream_comms(s, k);
    std::unique_ptr<ddp_context> h(new ddp_context);
    h->impl.reset(new Context(k, s, std::move(stream_comms)));
    *out = h.release();
  });
}

ddp_status_t ddp_register_grad(ddp_t d, void* grad, size_t numel, ddp_dtype_t dtype, unsigned flags, int* index) {
  return guard(__func__, [&] {
    Context& c = context_of(d);
    need(index, "index");
    const int dt = enum_value(dtype);
    if (!dtype_valid(dt)) fail(DDP_ERR_INVALID_ARGUMENT, "dtype %d is not a ddp_dtype_t (DDP_F16..DDP_F64)", dt);
    *index = c.register_grad(grad, numel, static_cast<Dtype>(dt), flags);
  });
}

ddp_status_t ddp_commit(ddp_t d) {
  return guard(__func__, [&] { context_of(d).commit(); });
}

ddp_status_t ddp_grad_ptr(ddp_t d, int index, void** grad) {
  return guard(__func__, [&] {
    Context& c = context_of(d);
    need(grad, "grad");
    *grad = c.grad_ptr(index);
  });
}

ddp_status_t ddp_set_grad_ptr(ddp_t d, int index, void* grad) {
  return guard(__func__, [&] { context_of(d).set_grad_ptr(index, grad); });
}

ddp_status_t ddp_begin_backward(ddp_t d, void* stream) {
  return guard(__func__, [&] { context_of(d).begin_backward(stream); });
}

ddp_status_t ddp_grad_ready(ddp_t d, int index) {
  return guard(__func__, [&] { context_of(d).grad_ready(index, nullptr); });
}

ddp_status_t ddp_grad_ready_ptr(ddp_t d, int index, void* grad) {
  return guard(__func__, [&] { context_of(d).grad_ready(index, grad); });
}

ddp_status_t ddp_finish_backward(ddp_t d, void* stream) {
  return guard(__func__, [&] { context_of(d).finish_backward(stream); });
}

ddp_status_t ddp_set_sync(ddp_t d, int enabled) {
  return guard(__func__, [&] { context_of(d).set_sync(enabled != 0); });
}

ddp_status_t ddp_reduce_all(ddp_t d, void* stream) {
  return guard(__func__, [&] { context_of(d).reduce_all(stream); });
}

ddp_status_t ddp_broadcast(ddp_t d, void* const* buffers, const size_t* counts, const ddp_dtype_t* dtypes, int n,
                           int root, void* stream) {
  return guard(__func__, [&] { context_of(d).broadcast(buffers, counts, dtypes, n, root, stream); });
}

ddp_status_t ddp_synchronize(ddp_t d) {
  return guard(__func__, [&] { context_of(d).synchronize(); });
}

ddp_status_t ddp_join(ddp_t d, int64_t* all_joined_iteration) {
  return guard(__func__, [&] {
    const uint64_t n = context_of(d).join();
    if (all_joined_iteration) *all_joined_iteration = static_cast<int64_t>(n);
  });
}

ddp_status_t ddp_recover(ddp_t d, ddp_membership_t* membership, int* members, size_t capacity) {
  return guard(__func__, [&] {
    if (capacity > 0 && !members) fail(DDP_ERR_INVALID_ARGUMENT, "members is NULL with capacity %zu", capacity);
    context_of(d).recover(membership, members, capacity);
  });
}

ddp_status_t ddp_allreduce_host(ddp_t d, void* buf, size_t count, ddp_dtype_t dtype, ddp_op_t op) {
  return guard(__func__, [&] { context_of(d).allreduce_host(buf, count, enum_value(dtype), enum_value(op)); });
}

ddp_status_t ddp_barrier(ddp_t d) {
  return guard(__func__, [&] { context_of(d).barrier(); });
}

ddp_status_t ddp_get_stats(ddp_t d, ddp_stats_t* stats) {
  return guard(__func__, [&] {
    Context& c = context_of(d);
    need(stats, "stats");
    if (stats->size < offsetof(ddp_stats_t, iterations) + sizeof(uint64_t))
      fail(DDP_ERR_INVALID_ARGUMENT, "stats->size is %zu: set it to sizeof(ddp_stats_t)", stats->size);
    c.stats(stats);
  });
}

ddp_status_t ddp_get_plan(ddp_t d, int* num_buckets, int* learned) {
  return guard(__func__, [&] {
    Context& c = context_of(d);
    need(num_buckets, "num_buckets");
    c.plan_info(num_buckets, learned);
  });
}

ddp_status_t ddp_get_bucket(ddp_t d, int bucket, ddp_bucket_info_t* info, int* grads, size_t capacity) {
  return guard(__func__, [&] {
    Context& c = context_of(d);
    need(info, "info");
    if (info->size < offsetof(ddp_bucket_info_t, dtype) + sizeof(ddp_dtype_t))
      fail(DDP_ERR_INVALID_ARGUMENT, "info->size is %zu: set it to sizeof(ddp_bucket_info_t)", info->size);
    c.bucket_info(bucket, info, grads, capacity);
  });
}

ddp_status_t ddp_get_shard(ddp_t d, int bucket, ddp_shard_info_t* info) {
  return guard(__func__, [&] {
    Context& c = context_of(d);
    need(info, "info");
    if (info->size < offsetof(ddp_shard_info_t, grad_shard) + sizeof(void*))
      fail(DDP_ERR_INVALID_ARGUMENT, "info->size is %zu: set it to sizeof(ddp_shard_info_t)", info->size);
    c.shard_info(bucket, info);
  });
}

ddp_status_t ddp_grad_shard(ddp_t d, int index, size_t* first, size_t* count, size_t* shard_pos) {
  return guard(__func__, [&] { context_of(d).grad_shard(index, first, count, shard_pos); });
}

ddp_status_t ddp_param_ptr(ddp_t d, int index, void** param) {
  return guard(__func__, [&] {
    Context& c = context_of(d);
    need(param, "param");
    *param = c.param_ptr(index);
  });
}

ddp_status_t ddp_broadcast_params(ddp_t d, int root, void* stream) {
  return guard(__func__, [&] { context_of(d).broadcast_params(root, stream); });
}

ddp_status_t ddp_gather_params(ddp_t d, void* stream) {
  return guard(__func__, [&] { context_of(d).gather_params(stream); });
}

ddp_status_t ddp_wait_grad(ddp_t d, int index, void* stream, int* reduced) {
  return guard(__func__, [&] {
    Context& c = context_of(d);
    need(reduced, "reduced");
    const bool done = c.wait_grad(index, stream);
    *reduced = done ? 1 : 0;  // written on success only, as every out-parameter
  });
}

ddp_status_t ddp_wait_params(ddp_t d, int index, void* stream) {
  return guard(__func__, [&] { context_of(d).wait_params(index, stream); });
}

ddp_status_t ddp_shard_norm(ddp_t d, void* stream, double* norm, uint64_t* nonfinite) {
  return guard(__func__, [&] {
    Context& c = context_of(d);
    need(norm, "norm");
    c.shard_norm(stream, norm, nonfinite);
  });
}

ddp_status_t ddp_destroy(ddp_t d) {
  return guard(__func__, [&] {
    refuse_reentry(d);
    delete d;
  });
}

ddp_status_t ddp_set_log_callback(ddp_log_fn fn, void* user) {
  return guard(__func__, [&] { set_log_callback(fn, user); });
}

}  // extern "C"
