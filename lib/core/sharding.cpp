// Sharded contexts: where each rank's shard lies, the parameter arena and its all-gather, and the
// global grad norm over shards. The reduce-scatter itself is the reducer's (reducer.cpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/context.hpp"

namespace ddp {

namespace {

#define DDP_SHARD_SPAN_(f) DDP_FIELD_SPAN(ddp_shard_info_t, f)
constexpr FieldSpan kShardSpans[] = {
    DDP_SHARD_SPAN_(dtype),        DDP_SHARD_SPAN_(bucket_numel), DDP_SHARD_SPAN_(shard_numel),
    DDP_SHARD_SPAN_(shard_offset), DDP_SHARD_SPAN_(arena_offset), DDP_SHARD_SPAN_(grad_shard),
    DDP_SHARD_SPAN_(param_shard),  DDP_SHARD_SPAN_(grads_numel),
};
#undef DDP_SHARD_SPAN_
constexpr size_t kNumShard = sizeof kShardSpans / sizeof kShardSpans[0];
static_assert(spans_cover(kShardSpans, kNumShard, sizeof(size_t), sizeof(ddp_shard_info_t), alignof(ddp_shard_info_t)),
              "every field of ddp_shard_info_t needs its span in kShardSpans");

}  // namespace

void Context::check_sharded() const {
  check_alive();
  if (!cfg_.sharded())
    fail(DDP_ERR_INVALID_STATE,
         "this call needs a sharded context (config.shard = 1, with the arena layout and the registration plan)");
}

void Context::shards_reduced(bool synced) {
  if (synced) pass_.gathered = false;
  pass_.shards_local = !synced;
}

void Context::shard_info(int bucket, ddp_shard_info_t* info) {
  std::lock_guard<std::mutex> lock(mu_);
  check_sharded();
  fatal_on_error([&] { commit_locked(); });
  const int nb = static_cast<int>(reducer().plan().buckets.size());
  if (bucket < 0 || bucket >= nb) fail(DDP_ERR_INVALID_ARGUMENT, "bucket %d out of range (%d buckets)", bucket, nb);
  const ShardSet::View v = reducer().shards().view(bucket);
  ddp_shard_info_t full;
  std::memset(&full, 0, sizeof full);
  full.dtype = static_cast<ddp_dtype_t>(v.dtype);
  full.bucket_numel = v.padded;
  full.shard_numel = v.shard_n;
  full.shard_offset = v.lo;
  full.arena_offset = v.arena_byte;
  full.grad_shard = v.grad;
  full.param_shard = v.param;
  full.grads_numel = v.numel;
  copy_fields(info, &full, info->size, kShardSpans, kNumShard);
}

void Context::grad_shard(int index, size_t* first, size_t* count, size_t* shard_pos) {
  std::lock_guard<std::mutex> lock(mu_);
  check_sharded();
  check_index(index);
  fatal_on_error([&] { commit_locked(); });
  const Plan& p = reducer().plan();
  const int b = p.bucket_of[static_cast<size_t>(index)];
  const size_t off =
      p.buckets[static_cast<size_t>(b)].offsets[static_cast<size_t>(p.slot_of[static_cast<size_t>(index)])];
  const size_t n = regs_.specs[static_cast<size_t>(index)].numel;
  const ShardSet::View v = reducer().shards().view(b);
  const size_t lo = std::max(v.lo, off), hi = std::min(v.lo + v.shard_n, off + n);
  const bool owns = lo < hi;
  if (first) *first = owns ? lo - off : 0;
  if (count) *count = owns ? hi - lo : 0;
  if (shard_pos) *shard_pos = owns ? lo - v.lo : 0;
}

void* Context::param_ptr(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  check_sharded();
  check_index(index);
  fatal_on_error([&] { commit_locked(); });
  return reducer().shards().param_of(reducer().grad_ptr(index));
}

void Context::broadcast_params(int root, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_sharded();
  if (root < 0 || root >= world()) fail(DDP_ERR_INVALID_ARGUMENT, "root %d out of range 0..%d", root, world() - 1);
  if (pass_.state == State::InBackward) fail(DDP_ERR_INVALID_STATE, "not allowed inside a backward pass");
  CallScope scope(this, Call::Broadcast);
  fatal_on_error([&] {
    commit_locked();
    // Gathers still in flight would write the arena behind the broadcast.
    for (auto& s : gen_->streams()) s->drain(deadline());
    gen_->bcast().broadcast(reducer().shards().params(), reducer().arena_bytes(), root, stream, deadline());
  });
}

void Context::gather_params(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_sharded();
  if (pass_.state == State::InBackward)
    fail(DDP_ERR_INVALID_STATE, "not inside a backward pass: the shards are final after ddp_finish_backward");
  if (pass_.gathered)
    fail(DDP_ERR_INVALID_STATE,
         "the parameters were already gathered since the last reduction (update the "
         "shards after the next ddp_finish_backward that synchronizes, then gather)");
  if (pass_.shards_local)
    fail(DDP_ERR_INVALID_STATE,
         "the shards are not final: the last backward pass ran with sync off and only "
         "accumulated local grads (finish a backward pass with sync on first)");
  fatal_on_error([&] {
    commit_locked();
    reducer().shards().launch_gather(stream);
  });
  pass_.gathered = true;
}

void Context::wait_params(int index, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_sharded();
  if (index != -1) check_index(index);
  if (!pass_.gathered)
    fail(DDP_ERR_INVALID_STATE,
         "no parameter gather was launched since the last reduction (call "
         "ddp_gather_params first)");
  CallScope scope(this, Call::WaitParams);
  fatal_on_error([&] {
    const Plan& p = reducer().plan();
    if (index >= 0) {
      reducer().shards().wait_gathered(p.bucket_of[static_cast<size_t>(index)], stream);
      return;
    }
    for (int b = static_cast<int>(p.buckets.size()); b-- > 0;) reducer().shards().wait_gathered(b, stream);
  });
}

// Each rank's own terms, then one exchange of two numbers, added in rank order: the same on every rank.
void Context::shard_norm(void* stream, double* norm, uint64_t* nonfinite) {
  std::lock_guard<std::mutex> lock(mu_);
  check_sharded();
  if (pass_.state == State::InBackward) fail(DDP_ERR_INVALID_STATE, "not allowed inside a backward pass");
  double mine[2] = {0.0, 0.0};
  std::vector<double> all(2 * static_cast<size_t>(world()));
  CallScope scope(this, Call::ShardNorm);
  fatal_on_error([&] {
    commit_locked();
    reducer().shards().norm_terms(stream, mine);
    CallRecord call;
    call.kind = kShardNorm;
    exchange_call(call);
    ctrl().allgather_host(mine, all.data(), sizeof mine, deadline());
  });
  double sq = 0.0, bad = 0.0;
  for (int r = 0; r < world(); ++r) {
    sq += all[2 * static_cast<size_t>(r)];
    bad += all[2 * static_cast<size_t>(r) + 1];
  }
  if (norm) *norm = std::sqrt(sq);
  if (nonfinite) *nonfinite = static_cast<uint64_t>(bad);
}

}  // namespace ddp
