// The C ABI shell of comm hooks: ddp_set_comm_hook's trampoline (the caller's function run as a
// blocking call on the bucket's stream, with the hook's thread-local scope set) and ddp_comm_allreduce,
// the collective a hook calls (also usable on any host comm outside a context).
#include <cstring>

#include "core/host_reduce.hpp"
#include "core/shell.hpp"

using namespace ddp;
using namespace ddp::shell;

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

extern "C" {

ddp_status_t ddp_set_comm_hook(ddp_t d, ddp_comm_hook_fn hook, void* user_data) {
  return guard(__func__, [&] {
    Context& c = context_of(d);
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
      HookScope& scope = running_hook();
      const HookScope outer = scope;
      scope = HookScope{&h, owner};
      last_error().clear();  // a hook that fails without a word must not borrow an older message
      // User code that may wait for anything, bracketed as a blocking call: a worker written off at
      // the timeout parks when it returns. Everything the library reads is read before it begins (the
      // function and its argument copied here), so nothing read races with the context's destruction.
      const ddp_comm_hook_fn fn = hook;
      void* const arg = user_data;
      // The status as an int, never stored as the enum: a hook may return any int (-1 for a failure),
      // and an enum object holding a value outside its enumerators is undefined behaviour in C++.
      int st = DDP_SUCCESS;
      h.stream->run_blocking([&] { st = static_cast<int>(fn(&b, arg)); });
      scope = outer;
      if (st != DDP_SUCCESS)
        fail(st == DDP_ERR_TIMEOUT ? DDP_ERR_TIMEOUT : DDP_ERR_ABORTED, "comm hook returned %d (%s) for bucket %d: %s",
             st, status_name(st), h.bucket,
             last_error().empty() ? "(the hook set no libddp error)" : last_error().c_str());
    });
  });
}

ddp_status_t ddp_comm_allreduce(ddp_comm_t c, void* buf, size_t count, ddp_dtype_t dtype, ddp_op_t op, void* stream) {
  return guard(__func__, [&] {
    Comm& k = comm_of(c);
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
    const HookCall* hook = running_hook().call;
    const bool in_hook = hook && hook->comm == &k;
    if (!in_hook && k.memory() == Memory::Device)
      fail(DDP_ERR_UNSUPPORTED,
           "device memory outside a comm hook: reduce on your own stream with NCCL, or host "
           "values with ddp_allreduce_host");
    const Deadline dl = in_hook ? hook->deadline : Deadline::after_ms(default_init_timeout_ms());
    agree_comm_allreduce(k, count, dt, o, dl);
    if (count == 0 && !k.checks_shapes()) return;  // agreed: every rank has nothing (a local group compares below)
    if (in_hook) return k.allreduce(buf, buf, count, d, red, *hook->stream, dl);
    (void)stream;
    CallingThread s;
    k.allreduce(buf, buf, count, d, red, s, dl);
  });
}

}  // extern "C"
