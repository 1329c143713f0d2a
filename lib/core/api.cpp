// The C ABI shell: argument checks, status codes, the per-thread last-error text, and the C handles
// resolved into the objects behind them. No exception crosses this file: each entry point runs its
// body inside guard(__func__, ...), which turns any exception into a status and a message that starts
// with the entry point's name.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "ddp.h"
#include "core/handles.hpp"
#include "core/host_reduce.hpp"
#include "core/knobs.hpp"
#include "core/launcher.hpp"
#include "core/comms.hpp"
#include "core/log.hpp"

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
    return set_error(e.status(), (std::string(fn) + ": " + e.what()).c_str());
  } catch (const std::bad_alloc&) {
    return set_error(DDP_ERR_OUT_OF_MEMORY, (std::string(fn) + ": out of host memory").c_str());
  } catch (const std::exception& e) {
    return set_error(DDP_ERR_INTERNAL, (std::string(fn) + ": internal error: " + e.what()).c_str());
  } catch (...) {
    return set_error(DDP_ERR_INTERNAL, (std::string(fn) + ": internal error (unknown exception)").c_str());
  }
}

template <class T>
void need(const T* p, const char* what) {
  if (!p) fail(DDP_ERR_INVALID_ARGUMENT, "%s is NULL", what);
}

// The comm hook being run on this thread (ddp_comm_allreduce inside it uses its stream and deadline),
// and the context it belongs to.
thread_local const HookCall* t_hook = nullptr;
thread_local const Context* t_hook_ctx = nullptr;

// A context is never entered from its own comm hook: the thread that launched or waits for the
// bucket may hold the context's lock (a host hook runs on a bucket worker while ddp_finish_backward
// waits for it; a GPU hook runs inside ddp_grad_ready), so such a call could only deadlock.
void refuse_reentry(const ddp_t d) {
  if (d && t_hook_ctx && t_hook_ctx == d->impl.get())
    fail(DDP_ERR_INVALID_STATE,
         "called from inside this context's comm hook (bucket %d): a hook may call only ddp_comm_allreduce on "
         "bucket->comm",
         t_hook->bucket);
}

Context& ctx(ddp_t d) {
  if (!d) fail(DDP_ERR_INVALID_ARGUMENT, "the ddp_t handle is NULL");
  refuse_reentry(d);
  return *d->impl;
}

// config.stream_comms: num_streams C handles, each over the same ranks and memory as `base`.
void resolve_stream_comms(Settings& s, const Comm& base) {
  const ddp_comm_t* handles = s.c.stream_comms;
  s.c.stream_comms = nullptr;  // the caller's array is borrowed for this call only
  if (!handles) return;
  auto kind = [](Memory m) { return m == Memory::Host ? "host" : "device"; };
  for (int i = 0; i < s.c.num_streams; ++i) {
    if (!handles[i]) fail(DDP_ERR_INVALID_ARGUMENT, "config.stream_comms[%d] is NULL", i);
    Comm* sc = handles[i]->impl.get();
    if (sc->size() != base.size() || sc->memory() != base.memory())
      fail(DDP_ERR_INVALID_ARGUMENT,
           "config.stream_comms[%d] spans %d ranks of %s memory; the context's comm spans %d ranks of %s memory", i,
           sc->size(), kind(sc->memory()), base.size(), kind(base.memory()));
    s.stream_comms.push_back(sc);
  }
}

Comm& comm(ddp_comm_t c) {
  if (!c) fail(DDP_ERR_INVALID_ARGUMENT, "the ddp_comm_t handle is NULL");
  return c->get();
}

ddp_comm_t wrap(std::unique_ptr<Comm> c) {
  ddp_comm_t h = new ddp_comm;
  h->impl = std::move(c);
  return h;
}

// A status's text from its int (what a hook returns may be any int).
const char* status_name(int status) {
  switch (status) {
#define DDP_STATUS_CASE_(name, value, text) \
  case name: return text;
    DDP_STATUS_MAP(DDP_STATUS_CASE_)
#undef DDP_STATUS_CASE_
    default: return "unknown status";
  }
}

}  // namespace

extern "C" {

const char* ddp_status_string(ddp_status_t status) { return status_name(enum_value(status)); }

const char* ddp_last_error(void) { return t_last_error.c_str(); }

int ddp_version(void) { return DDP_VERSION_CODE; }

/* ---- communicators ---- */

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
// The bound of the NCCL creation calls without a timeout argument: DDP_INIT_TIMEOUT_MS, else the
// default collective timeout.
int64_t default_init_timeout_ms() { return knobs::init_timeout_ms(); }

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
    Comm& k = comm(c);
    need(rank, "rank");
    check_admitted(k);
    *rank = k.rank();
  });
}

ddp_status_t ddp_comm_size(ddp_comm_t c, int* size) {
  return guard(__func__, [&] {
    Comm& k = comm(c);
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

/* ---- config and context ---- */

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
    Comm& k = comm(c);
    need(out, "ddp");
    Settings s = read_config(config);
    resolve_stream_comms(s, k);
    std::unique_ptr<ddp_context> h(new ddp_context);
    h->impl.reset(new Context(k, s));
    *out = h.release();
  });
}

ddp_status_t ddp_register_grad(ddp_t d, void* grad, size_t numel, ddp_dtype_t dtype, unsigned flags, int* index) {
  return guard(__func__, [&] {
    Context& c = ctx(d);
    need(index, "index");
    const int dt = enum_value(dtype);
    if (!dtype_valid(dt)) fail(DDP_ERR_INVALID_ARGUMENT, "dtype %d is not a ddp_dtype_t (DDP_F16..DDP_F64)", dt);
    *index = c.register_grad(grad, numel, static_cast<Dtype>(dt), flags);
  });
}

ddp_status_t ddp_commit(ddp_t d) {
  return guard(__func__, [&] { ctx(d).commit(); });
}

ddp_status_t ddp_grad_ptr(ddp_t d, int index, void** grad) {
  return guard(__func__, [&] {
    Context& c = ctx(d);
    need(grad, "grad");
    *grad = c.grad_ptr(index);
  });
}

ddp_status_t ddp_set_grad_ptr(ddp_t d, int index, void* grad) {
  return guard(__func__, [&] { ctx(d).set_grad_ptr(index, grad); });
}

ddp_status_t ddp_begin_backward(ddp_t d, void* stream) {
  return guard(__func__, [&] { ctx(d).begin_backward(stream); });
}

ddp_status_t ddp_grad_ready(ddp_t d, int index) {
  return guard(__func__, [&] { ctx(d).grad_ready(index, nullptr); });
}

ddp_status_t ddp_grad_ready_ptr(ddp_t d, int index, void* grad) {
  return guard(__func__, [&] { ctx(d).grad_ready(index, grad); });
}

ddp_status_t ddp_finish_backward(ddp_t d, void* stream) {
  return guard(__func__, [&] { ctx(d).finish_backward(stream); });
}

ddp_status_t ddp_set_sync(ddp_t d, int enabled) {
  return guard(__func__, [&] { ctx(d).set_sync(enabled != 0); });
}

ddp_status_t ddp_reduce_all(ddp_t d, void* stream) {
  return guard(__func__, [&] { ctx(d).reduce_all(stream); });
}

ddp_status_t ddp_broadcast(ddp_t d, void* const* buffers, const size_t* counts, const ddp_dtype_t* dtypes, int n,
                           int root, void* stream) {
  return guard(__func__, [&] { ctx(d).broadcast(buffers, counts, dtypes, n, root, stream); });
}

ddp_status_t ddp_synchronize(ddp_t d) {
  return guard(__func__, [&] { ctx(d).synchronize(); });
}

ddp_status_t ddp_join(ddp_t d, int64_t* all_joined_iteration) {
  return guard(__func__, [&] {
    const uint64_t n = ctx(d).join();
    if (all_joined_iteration) *all_joined_iteration = static_cast<int64_t>(n);
  });
}

ddp_status_t ddp_recover(ddp_t d, ddp_membership_t* membership, int* members, size_t capacity) {
  return guard(__func__, [&] {
    if (capacity > 0 && !members) fail(DDP_ERR_INVALID_ARGUMENT, "members is NULL with capacity %zu", capacity);
    ctx(d).recover(membership, members, capacity);
  });
}

ddp_status_t ddp_allreduce_host(ddp_t d, void* buf, size_t count, ddp_dtype_t dtype, ddp_op_t op) {
  return guard(__func__, [&] { ctx(d).allreduce_host(buf, count, enum_value(dtype), enum_value(op)); });
}

ddp_status_t ddp_barrier(ddp_t d) {
  return guard(__func__, [&] { ctx(d).barrier(); });
}

namespace {

// What ddp_comm_allreduce hands a host comm outside a hook: host comms run collectives on the
// calling thread and never use the stream.
class CallingThread final : public Stream {
 public:
  void reserve(size_t) override {}
  void submit(Task* t) override { t->run(); }
  void drain(Deadline) override {}
  bool runs_inline() const override { return true; }
  void* native() override { return nullptr; }
  void poll_error() override {}
  void cancel() override {}
};

// A buffer of `count` elements of `d` that the element loops can walk: aligned to its element, and
// not larger than the address space.
void check_buffer(const void* buf, size_t count, Dtype d) {
  const size_t es = dtype_size(d);
  if (count > static_cast<size_t>(PTRDIFF_MAX) / es)
    fail(DDP_ERR_INVALID_ARGUMENT, "%zu elements of %s are more bytes than an address space holds", count,
         dtype_name(d));
  check_aligned(buf, es, dtype_name(d), "buf");
}

// ddp_comm_allreduce's arguments, the same on every rank of a host comm that does not compare them
// itself: a transport handed different sizes reads past a buffer, truncates or aborts the process.
// Device comms are not compared (their data stays on the stream): a difference there is a hang that
// the timeout ends.
void agree_comm_allreduce(Comm& k, size_t count, int dtype, int op, Deadline dl) {
  if (k.memory() != Memory::Host || k.checks_shapes() || k.size() == 1) return;
  struct Args {
    uint64_t count;
    int32_t dtype, op;
  };
  const Args mine{count, dtype, op};
  std::vector<Args> all(static_cast<size_t>(k.size()));
  k.allgather_host(&mine, all.data(), sizeof mine, dl);
  for (int r = 0; r < k.size(); ++r) {
    const Args& o = all[static_cast<size_t>(r)];
    if (o.count != mine.count || o.dtype != mine.dtype || o.op != mine.op)
      fail(DDP_ERR_MISMATCH,
           "the ranks passed different arguments: rank %d %llu elements of %s (%s), rank %d %llu elements of %s (%s)",
           k.rank(), static_cast<unsigned long long>(mine.count), host_dtype_name(mine.dtype), op_name(mine.op), r,
           static_cast<unsigned long long>(o.count), host_dtype_name(o.dtype), op_name(o.op));
  }
}

}  // namespace

ddp_status_t ddp_set_comm_hook(ddp_t d, ddp_comm_hook_fn hook, void* user_data) {
  return guard(__func__, [&] {
    Context& c = ctx(d);
    if (!hook) return c.set_comm_hook(nullptr);
    const Context* owner = &c;
    c.set_comm_hook([hook, user_data, owner](const HookCall& h) {
      ddp_comm borrowed;
      borrowed.borrowed = h.comm;
      ddp_hook_bucket_t b;
      std::memset(&b, 0, sizeof b);
      b.size = sizeof b;
      b.bucket = h.bucket;
      b.stream_index = h.stream_index;
      b.iteration = h.iteration;
      b.buffer = h.buffer;
      b.count = h.count;
      b.dtype = static_cast<ddp_dtype_t>(static_cast<int>(h.dtype));
      b.stream = h.stream->native();
      b.comm = &borrowed;
      b.rank = h.comm->rank();
      b.world = h.comm->size();
      const HookCall* outer = t_hook;
      const Context* outer_ctx = t_hook_ctx;
      t_hook = &h;
      t_hook_ctx = owner;
      t_last_error.clear();  // a hook that fails without a word must not borrow an older message
      // User code that may wait for anything, bracketed as a blocking call: a worker written off at
      // the timeout parks when it returns. Everything the library reads is read before it begins (the
      // function and its argument copied here), so nothing read races with the context's destruction.
      const ddp_comm_hook_fn fn = hook;
      void* const arg = user_data;
      // The status as an int, never stored as the enum: a hook may return any int (-1 for a failure),
      // and an enum object holding a value outside its enumerators is undefined behaviour in C++.
      int st = DDP_SUCCESS;
      h.stream->run_blocking([&] { st = static_cast<int>(fn(&b, arg)); });
      t_hook = outer;
      t_hook_ctx = outer_ctx;
      if (st != DDP_SUCCESS)
        fail(st == DDP_ERR_TIMEOUT ? DDP_ERR_TIMEOUT : DDP_ERR_ABORTED, "comm hook returned %d (%s) for bucket %d: %s",
             st, status_name(st), h.bucket,
             t_last_error.empty() ? "(the hook set no libddp error)" : t_last_error.c_str());
    });
  });
}

ddp_status_t ddp_comm_allreduce(ddp_comm_t c, void* buf, size_t count, ddp_dtype_t dtype, ddp_op_t op, void* stream) {
  return guard(__func__, [&] {
    Comm& k = comm(c);
    const int dt = enum_value(dtype), o = enum_value(op);
    if (!dtype_valid(dt)) fail(DDP_ERR_INVALID_ARGUMENT, "dtype %d is not a float ddp_dtype_t (DDP_F16..DDP_F64)", dt);
    if (o != DDP_OP_SUM && o != DDP_OP_AVG)
      fail(DDP_ERR_INVALID_ARGUMENT, "op %d: ddp_comm_allreduce sums (DDP_OP_SUM) or averages (DDP_OP_AVG)", o);
    if (count > 0 && !buf) fail(DDP_ERR_INVALID_ARGUMENT, "buf is NULL for %zu elements", count);
    const Dtype d = static_cast<Dtype>(dt);
    check_buffer(buf, count, d);
    if (k.memory() == Memory::Device && !k.supports_wire(d))
      fail(DDP_ERR_UNSUPPORTED, "this communicator cannot sum %s", dtype_name(d));
    Reduction red;
    if (o == DDP_OP_AVG) {
      if (k.supports(RedOp::Avg))
        red = Reduction{RedOp::Avg, 1.0};
      else if (k.supports(RedOp::SumScaled))
        red = Reduction{RedOp::SumScaled, 1.0 / k.size()};
      else
        fail(DDP_ERR_UNSUPPORTED, "this communicator cannot average: sum, then scale");
    }
    const bool in_hook = t_hook && t_hook->comm == &k;
    if (!in_hook && k.memory() == Memory::Device)
      fail(DDP_ERR_UNSUPPORTED,
           "device memory outside a comm hook: reduce on your own stream with NCCL, or host "
           "values with ddp_allreduce_host");
    const Deadline dl = in_hook ? t_hook->deadline : Deadline::after_ms(default_init_timeout_ms());
    agree_comm_allreduce(k, count, dt, o, dl);
    if (count == 0 && !k.checks_shapes()) return;  // agreed: every rank has nothing (a local group compares below)
    if (in_hook) return k.allreduce(buf, buf, count, d, red, *t_hook->stream, dl);
    (void)stream;
    CallingThread s;
    k.allreduce(buf, buf, count, d, red, s, dl);
  });
}

ddp_status_t ddp_get_stats(ddp_t d, ddp_stats_t* stats) {
  return guard(__func__, [&] {
    Context& c = ctx(d);
    need(stats, "stats");
    if (stats->size < offsetof(ddp_stats_t, iterations) + sizeof(uint64_t))
      fail(DDP_ERR_INVALID_ARGUMENT, "stats->size is %zu: set it to sizeof(ddp_stats_t)", stats->size);
    c.stats(stats);
  });
}

ddp_status_t ddp_get_plan(ddp_t d, int* num_buckets, int* learned) {
  return guard(__func__, [&] {
    Context& c = ctx(d);
    need(num_buckets, "num_buckets");
    c.plan_info(num_buckets, learned);
  });
}

ddp_status_t ddp_get_bucket(ddp_t d, int bucket, ddp_bucket_info_t* info, int* grads, size_t capacity) {
  return guard(__func__, [&] {
    Context& c = ctx(d);
    need(info, "info");
    if (info->size < offsetof(ddp_bucket_info_t, dtype) + sizeof(ddp_dtype_t))
      fail(DDP_ERR_INVALID_ARGUMENT, "info->size is %zu: set it to sizeof(ddp_bucket_info_t)", info->size);
    c.bucket_info(bucket, info, grads, capacity);
  });
}

ddp_status_t ddp_get_shard(ddp_t d, int bucket, ddp_shard_info_t* info) {
  return guard(__func__, [&] {
    Context& c = ctx(d);
    need(info, "info");
    if (info->size < offsetof(ddp_shard_info_t, grad_shard) + sizeof(void*))
      fail(DDP_ERR_INVALID_ARGUMENT, "info->size is %zu: set it to sizeof(ddp_shard_info_t)", info->size);
    c.shard_info(bucket, info);
  });
}

ddp_status_t ddp_grad_shard(ddp_t d, int index, size_t* first, size_t* count, size_t* shard_pos) {
  return guard(__func__, [&] { ctx(d).grad_shard(index, first, count, shard_pos); });
}

ddp_status_t ddp_param_ptr(ddp_t d, int index, void** param) {
  return guard(__func__, [&] {
    Context& c = ctx(d);
    need(param, "param");
    *param = c.param_ptr(index);
  });
}

ddp_status_t ddp_broadcast_params(ddp_t d, int root, void* stream) {
  return guard(__func__, [&] { ctx(d).broadcast_params(root, stream); });
}

ddp_status_t ddp_gather_params(ddp_t d, void* stream) {
  return guard(__func__, [&] { ctx(d).gather_params(stream); });
}

ddp_status_t ddp_wait_grad(ddp_t d, int index, void* stream, int* reduced) {
  return guard(__func__, [&] {
    Context& c = ctx(d);
    need(reduced, "reduced");
    const bool done = c.wait_grad(index, stream);
    *reduced = done ? 1 : 0;  // written on success only, as every out-parameter
  });
}

ddp_status_t ddp_wait_params(ddp_t d, int index, void* stream) {
  return guard(__func__, [&] { ctx(d).wait_params(index, stream); });
}

ddp_status_t ddp_shard_norm(ddp_t d, void* stream, double* norm, uint64_t* nonfinite) {
  return guard(__func__, [&] {
    Context& c = ctx(d);
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
