// The context's control-path collectives: uneven inputs (the per-iteration vote, ddp_join and its
// shadow iterations), ddp_allreduce_host and ddp_barrier, and the comm hook's setting. Each call first
// exchanges what every rank is calling, so that ranks that called different things fail together.
#include <algorithm>
#include <cstring>

#include "core/context.hpp"
#include "core/host_reduce.hpp"

namespace ddp {

std::vector<CallRecord> Context::exchange_call(const CallRecord& mine, bool compare_count) {
  std::vector<CallRecord> all(static_cast<size_t>(world()));
  progress_.calls.fetch_add(1, std::memory_order_relaxed);  // the stall inspector: who never got here
  ctrl().allgather_host(&mine, all.data(), sizeof(CallRecord), deadline());
  for (int r = 0; r < world(); ++r) {
    const CallRecord& o = all[static_cast<size_t>(r)];
    // Joined and contributing ranks agree; contributing ranks must run the same kind of iteration.
    const bool votes = o.kind == kVote && mine.kind == kVote && (!o.flag || !mine.flag || o.op == mine.op);
    if (votes || (o.kind == mine.kind && o.dtype == mine.dtype && o.op == mine.op &&
                  (o.count == mine.count || !compare_count) && o.flag == mine.flag))
      continue;
    fail(DDP_ERR_MISMATCH, "the ranks called different collectives: rank %d %s, rank %d %s", rank(),
         describe_call(&mine).c_str(), r, describe_call(&o).c_str());
  }
  return all;
}

int Context::vote(int32_t kind, int32_t* theirs) {
  CallRecord mine;
  mine.kind = kVote;
  mine.flag = kind == kShadow ? 0 : 1;
  mine.op = kind;
  mine.count = kind == kShadow ? 0 : static_cast<uint64_t>(report_.local_passes());
  int n = 0;
  const std::vector<CallRecord> all = exchange_call(mine);
  std::vector<int32_t> passes(all.size(), -1);  // ddp_set_sync: contributors ran as many passes without sync
  for (size_t r = 0; r < all.size(); ++r) {
    n += all[r].flag;
    if (all[r].flag && theirs) *theirs = all[r].op;
    if (all[r].flag) passes[r] = static_cast<int32_t>(all[r].count);
  }
  check_sync_agreement(passes);
  if (n > 0 && cfg_.c.uneven_inputs == DDP_UNEVEN_BY_CONTRIBUTORS && n != reducer().divisor()) reducer().set_divisor(n);
  return n;
}

// One of the others' synced iterations, with every grad of this rank a zero contribution: the same
// buckets, collectives and control exchanges as theirs (a backward pass: the learned plan's first
// pass and the unused-grad report; ddp_reduce_all: neither).
void Context::shadow_iteration(int32_t kind) {
  const bool backward = kind == kBackwardPass;
  pass_.learning = backward && cfg_.learned() && !reducer().plan().learned;
  if (pass_.learning) learner_.reset(regs_.specs.size());
  reducer().begin(nullptr, pass_.iterations);
  pass_.last_exposed_ns = 0;
  progress_.iteration.store(static_cast<int64_t>(pass_.iterations), std::memory_order_relaxed);
  if (pass_.learning) {
    pass_.learning = false;
    learn_plan();
  }
  reducer().unready_grads(&pass_.unused);
  reducer().launch_rest();
  wait_buckets(nullptr);
  // The others' unused-grad report: this rank reports none (its grads are absent, not unused).
  if (backward && !cfg_.unused_zero()) (void)report_.exchange(ctrl(), std::vector<int>(), deadline(), false);
  ++pass_.iterations;
  shards_reduced(true);
}

uint64_t Context::join() {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (pass_.state == State::InBackward) fail(DDP_ERR_INVALID_STATE, "not allowed inside a backward pass");
  if (cfg_.c.uneven_inputs == DDP_UNEVEN_OFF)
    fail(DDP_ERR_INVALID_STATE,
         "ddp_join needs config.uneven_inputs (DDP_UNEVEN_BY_CONTRIBUTORS or DDP_UNEVEN_BY_WORLD) on every rank");
  if (!pass_.sync)
    fail(DDP_ERR_INVALID_STATE,
         "sync is off (ddp_set_sync(ddp, 0)): turn it on before ddp_join; a joined rank "
         "shadows synced iterations");
  CallScope scope(this, Call::Join, Call::Idle);
  fatal_on_error([&] {
    commit_locked();
    reducer().clear_feedback();  // the int8 wire's owed errors are not sent: a joined rank sends zeros
    int32_t theirs = kBackwardPass;
    while (vote(kShadow, &theirs) > 0) shadow_iteration(theirs);
    if (reducer().divisor() != world()) reducer().set_divisor(world());  // every rank contributes again
  });
  return pass_.iterations;
}

void Context::allreduce_host(void* buf, size_t count, int dtype, int op) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (pass_.state == State::InBackward) fail(DDP_ERR_INVALID_STATE, "not allowed inside a backward pass");
  if (!host_dtype_valid(dtype))
    fail(DDP_ERR_INVALID_ARGUMENT, "dtype %d is not a ddp_dtype_t (DDP_F16..DDP_F64, DDP_I32, DDP_I64)", dtype);
  if (op < DDP_OP_SUM || op > DDP_OP_MIN)
    fail(DDP_ERR_INVALID_ARGUMENT, "op %d is not a ddp_op_t (DDP_OP_SUM, _AVG, _MAX or _MIN)", op);
  if (count > 0 && !buf) fail(DDP_ERR_INVALID_ARGUMENT, "buf is NULL for %zu elements", count);
  const size_t es = host_dtype_size(dtype);
  check_aligned(buf, es, host_dtype_name(dtype), "buf");
  if (count > (size_t(1) << 31) / es / static_cast<size_t>(world()))
    fail(DDP_ERR_INVALID_ARGUMENT,
         "%zu elements of %s is too large for the control path (every rank's buffer "
         "reaches every rank): reduce grads through the buckets",
         count, host_dtype_name(dtype));
  CallScope scope(this, Call::HostAllreduce);
  fatal_on_error([&] {
    CallRecord mine;
    mine.kind = kHostAllreduce;
    mine.dtype = dtype;
    mine.op = op;
    mine.count = count;
    exchange_call(mine);
    if (count == 0) return;
    std::vector<char> all(count * es * static_cast<size_t>(world()));
    ctrl().allgather_host(buf, all.data(), count * es, deadline());
    reduce_in_rank_order(all.data(), world(), count, dtype, op, buf);
  });
}

void Context::agree_broadcast(const size_t* counts, const ddp_dtype_t* dtypes, int n, int root) {
  CallRecord mine;
  mine.kind = kBroadcast;
  mine.dtype = n;
  mine.op = root;
  Digest digest;  // every buffer's (count, dtype)
  for (int i = 0; i < n; ++i) {
    digest.mix(counts[i]);
    digest.mix(static_cast<uint64_t>(enum_value(dtypes[i])));
  }
  mine.count = digest.h;
  const std::vector<CallRecord> all = exchange_call(mine, false);
  bool same = true;
  for (const CallRecord& r : all) same = same && r.count == mine.count;
  if (same) return;
  // Every rank saw the same records, so all take this second round and name the same buffer.
  struct Buffer {
    uint64_t count;
    int64_t dtype;
  };
  std::vector<Buffer> layout(static_cast<size_t>(n)), every(static_cast<size_t>(n) * static_cast<size_t>(world()));
  for (int i = 0; i < n; ++i) layout[static_cast<size_t>(i)] = Buffer{counts[i], enum_value(dtypes[i])};
  ctrl().allgather_host(layout.data(), every.data(), layout.size() * sizeof(Buffer), deadline());
  for (size_t i = 0; i < layout.size(); ++i)
    for (int r = 1; r < world(); ++r) {
      const Buffer& a = every[i];
      const Buffer& b = every[static_cast<size_t>(r) * layout.size() + i];
      if (a.count != b.count || a.dtype != b.dtype)
        fail(DDP_ERR_MISMATCH,
             "the ranks passed different buffers to ddp_broadcast: buffer %zu is %llu elements of %s on rank 0 but "
             "%llu elements of %s on rank %d",
             i, static_cast<unsigned long long>(a.count), host_dtype_name(static_cast<int>(a.dtype)),
             static_cast<unsigned long long>(b.count), host_dtype_name(static_cast<int>(b.dtype)), r);
    }
  fail(DDP_ERR_MISMATCH, "the ranks passed different buffers to ddp_broadcast (their signatures differ)");
}

void Context::barrier() {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (pass_.state == State::InBackward) fail(DDP_ERR_INVALID_STATE, "not allowed inside a backward pass");
  CallScope scope(this, Call::Barrier);
  CallRecord mine;
  mine.kind = kBarrier;
  fatal_on_error([&] { exchange_call(mine); });
}

void Context::set_comm_hook(std::function<void(const HookCall&)> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive(true);
  if (pass_.state != State::Open)
    fail(DDP_ERR_INVALID_STATE, "a comm hook is set before the first backward pass (while registration is open)");
  if (hook && cfg_.sharded())
    fail(DDP_ERR_INVALID_STATE, "a comm hook replaces the allreduce; sharded contexts reduce-scatter (config.shard)");
  if (hook && cfg_.c.compression != DDP_COMPRESS_NONE)
    fail(DDP_ERR_INVALID_STATE, "config.compression is set: a comm hook decides the wire itself");
  hook_ = std::move(hook);
}

}  // namespace ddp
