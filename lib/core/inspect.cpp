// What a context tells about itself: counters, the plan and its buckets.
#include <cstring>

#include "core/context.hpp"

namespace ddp {

void Context::stats(ddp_stats_t* out) {
  std::lock_guard<std::mutex> lock(mu_);
  ddp_stats_t s;
  std::memset(&s, 0, sizeof s);
  s.size = sizeof s;
  s.iterations = iterations_;
  s.buckets_reduced = counters_.buckets_reduced.load();
  s.bytes_reduced = counters_.bytes_reduced.load();
  s.comm_time_ns = counters_.comm_time_ns.load();
  s.exposed_time_ns = exposed_ns_;
  s.last_exposed_ns = last_exposed_ns_;
  s.library_bytes = reducer_ ? reducer_->buffer_bytes() : 0;
  s.arena_bytes = reducer_ ? reducer_->arena_bytes() : 0;
  s.nonfinite_buckets = counters_.nonfinite_buckets.load();
  s.layout_epoch = layout_epoch_;
  s.world_size = world_;
  s.rank = rank_;
  copy_sized(out, &s, out->size, sizeof s);
}

// The plan getters close registration (collective), and still answer after an abort if a plan exists.
const Plan& Context::committed_plan() {
  if (!aborted_) fatal_on_error([&] { commit_locked(); });
  if (!reducer_) check_alive();
  return reducer_->plan();
}

void Context::plan_info(int* num_buckets, int* learned) {
  std::lock_guard<std::mutex> lock(mu_);
  const Plan& p = committed_plan();
  *num_buckets = static_cast<int>(p.buckets.size());
  if (learned) *learned = p.learned ? 1 : 0;
}

void Context::bucket_info(int bucket, ddp_bucket_info_t* info, int* grads, size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  const Plan& p = committed_plan();
  if (bucket < 0 || static_cast<size_t>(bucket) >= p.buckets.size())
    fail(DDP_ERR_INVALID_ARGUMENT, "bucket %d out of range (%zu buckets)", bucket, p.buckets.size());
  if (capacity > 0 && !grads) fail(DDP_ERR_INVALID_ARGUMENT, "grads is NULL but capacity is %zu", capacity);
  const Bucket& b = p.buckets[static_cast<size_t>(bucket)];
  info->dtype = static_cast<ddp_dtype_t>(b.dtype);
  info->wire = static_cast<ddp_dtype_t>(reducer_->wire(bucket));
  info->numel = b.numel;
  info->num_grads = static_cast<int>(b.grads.size());
  info->stream = b.stream;
  for (size_t i = 0; i < capacity && i < b.grads.size(); ++i) grads[i] = b.grads[i];
}

}  // namespace ddp
