// What a context tells about itself: its statistics (ddp_get_stats), the plan and its buckets.
#include <algorithm>
#include <cstring>

#include "core/context.hpp"

namespace ddp {

namespace {

// The fields after the leading `size` of the sized structs written out to callers: each is written only
// when it lies wholly within the caller's size, so no caller's struct is written past its end.
#define DDP_STATS_SPAN_(f) DDP_FIELD_SPAN(ddp_stats_t, f)
constexpr FieldSpan kStatsSpans[] = {
    DDP_STATS_SPAN_(iterations),        DDP_STATS_SPAN_(buckets_reduced),     DDP_STATS_SPAN_(bytes_reduced),
    DDP_STATS_SPAN_(comm_time_ns),      DDP_STATS_SPAN_(exposed_time_ns),     DDP_STATS_SPAN_(last_exposed_ns),
    DDP_STATS_SPAN_(library_bytes),     DDP_STATS_SPAN_(arena_bytes),         DDP_STATS_SPAN_(nonfinite_buckets),
    DDP_STATS_SPAN_(layout_epoch),      DDP_STATS_SPAN_(world_size),          DDP_STATS_SPAN_(rank),
    DDP_STATS_SPAN_(bytes_sent),        DDP_STATS_SPAN_(bytes_received),      DDP_STATS_SPAN_(straggler_rank),
    DDP_STATS_SPAN_(straggler_kind),    DDP_STATS_SPAN_(straggler_ms),        DDP_STATS_SPAN_(late_input_p50_ms),
    DDP_STATS_SPAN_(late_input_p99_ms), DDP_STATS_SPAN_(late_compute_p50_ms), DDP_STATS_SPAN_(late_compute_p99_ms),
    DDP_STATS_SPAN_(late_wire_p50_ms),  DDP_STATS_SPAN_(late_wire_p99_ms),    DDP_STATS_SPAN_(straggler_warnings),
};
#undef DDP_STATS_SPAN_
#define DDP_BUCKET_SPAN_(f) DDP_FIELD_SPAN(ddp_bucket_info_t, f)
constexpr FieldSpan kBucketSpans[] = {
    DDP_BUCKET_SPAN_(dtype),     DDP_BUCKET_SPAN_(wire),   DDP_BUCKET_SPAN_(numel),
    DDP_BUCKET_SPAN_(num_grads), DDP_BUCKET_SPAN_(stream),
};
#undef DDP_BUCKET_SPAN_
constexpr size_t kNumStats = sizeof kStatsSpans / sizeof kStatsSpans[0];
constexpr size_t kNumBucket = sizeof kBucketSpans / sizeof kBucketSpans[0];
static_assert(spans_cover(kStatsSpans, kNumStats, sizeof(size_t), sizeof(ddp_stats_t), alignof(ddp_stats_t)),
              "every field of ddp_stats_t needs its span in kStatsSpans");
static_assert(spans_cover(kBucketSpans, kNumBucket, sizeof(size_t), sizeof(ddp_bucket_info_t),
                          alignof(ddp_bucket_info_t)),
              "every field of ddp_bucket_info_t needs its span in kBucketSpans");

}  // namespace

void Context::stats(ddp_stats_t* out) {
  std::lock_guard<std::mutex> lock(mu_);
  ddp_stats_t s;
  std::memset(&s, 0, sizeof s);
  s.size = sizeof s;
  s.iterations = pass_.iterations;
  s.buckets_reduced = stats_.buckets_reduced.load();
  s.bytes_reduced = stats_.bytes_reduced.load();
  s.comm_time_ns = stats_.comm_time_ns.load();
  s.exposed_time_ns = pass_.exposed_ns;
  s.last_exposed_ns = pass_.last_exposed_ns;
  const Reducer* r = gen_ ? gen_->reducer() : nullptr;
  s.library_bytes = r ? r->buffer_bytes() : 0;
  if (gen_)
    for (const Comm* c : gen_->comms()) s.library_bytes += c->buffer_bytes();
  s.arena_bytes = r ? r->arena_bytes() : 0;
  s.nonfinite_buckets = stats_.nonfinite_buckets.load();
  s.layout_epoch = pass_.layout_epoch;
  s.world_size = world();
  s.rank = rank();
  stragglers_.fill(s);
  uint64_t wire[2];
  wire_totals(true, wire);
  s.bytes_sent = wire[0];
  s.bytes_received = wire[1];
  copy_fields(out, &s, out->size, kStatsSpans, kNumStats);
}

// Borrowed stream comms count from the context's creation on (wire_base_); generations retired
// count what they carried (wire_carried_).
void Context::wire_totals(bool own, uint64_t out[2]) const {
  out[0] = out[1] = 0;
  if (gen_) gen_->wire_totals(own, out);
  if (!own) return;
  out[0] += wire_carried_[0] - wire_base_[0];
  out[1] += wire_carried_[1] - wire_base_[1];
}

// The plan getters close registration (collective), and still answer after an abort if a plan exists.
const Plan& Context::committed_plan() {
  if (!health_.aborted) fatal_on_error([&] { commit_locked(); });
  if (!gen_ || !gen_->reducer()) check_alive();
  return reducer().plan();
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
  ddp_bucket_info_t full;
  std::memset(&full, 0, sizeof full);
  full.dtype = static_cast<ddp_dtype_t>(b.dtype);
  full.wire = static_cast<ddp_dtype_t>(reducer().wire(bucket));
  full.numel = b.numel;
  full.num_grads = static_cast<int>(b.grads.size());
  full.stream = b.stream;
  copy_fields(info, &full, info->size, kBucketSpans, kNumBucket);
  for (size_t i = 0; i < capacity && i < b.grads.size(); ++i) grads[i] = b.grads[i];
}

}  // namespace ddp
