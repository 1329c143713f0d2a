#include "core/reducer.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "kernels/elementwise.h"

namespace ddp {

namespace {

// Whether `f` is exactly a value of the 16-bit type `d`.
bool exact_in(Dtype d, double f) {
  const float x = static_cast<float>(f);
  if (static_cast<double>(x) != f) return false;
  const float y = d == Dtype::F16 ? elem::f16_to_f32(elem::f32_to_f16(x)) : elem::bf16_to_f32(elem::f32_to_bf16(x));
  return y == x;
}

}  // namespace

struct Reducer::BucketTask final : Task {
  Reducer* reducer = nullptr;
  int bucket = 0;
  Phase phase = Phase::All;  // only a grouped GPU launch runs the phases one by one
  void run() override;
};

// A bucket's parameter all-gather (sharded contexts): a task of its own, since it may still be queued
// when the bucket's next reduction is submitted.
struct Reducer::GatherTask final : Task {
  Reducer* reducer = nullptr;
  int bucket = 0;
  uint64_t epoch = 0;
  void run() override;
};

struct Reducer::BucketRt {
  BucketTask task;
  GatherTask gather_task;
  std::atomic<uint64_t> gathered{0};  // host: the epoch of the last gather that completed
  size_t padded = 0;                  // elements with the shard padding (sharded), else numel
  size_t shard_n = 0;                 // elements per rank's shard (sharded)
  SegmentTable packed;                // copy layout: grads packed into staging; arena: each grad's view
  SegmentTable direct;                // copy layout: grads reduced in place, each its own collective
  std::vector<std::pair<SegmentTable*, size_t>> where;  // per slot: its table entry
  size_t packed_numel = 0;
  size_t stage_offset = 0;  // bytes into its stream's staging buffer
  Reduction red;            // what the collective fuses, and the factors left as passes
  double pre = 1.0, post = 1.0;
  size_t piece = 0;  // elements per collective piece (host comms), 0: the whole bucket at once
  Dtype wire = Dtype::F32;
  bool int8 = false;              // travels as int8 blocks (DDP_COMPRESS_INT8)
  size_t int8_chunk = 0;          // bytes of this rank's chunk of it
  size_t residual_at = 0;         // its first kept rounding error in residual_
  std::atomic<bool> done{false};  // this iteration's work finished (names the bucket a timeout hit)
  int size = 0;
  int ready = 0;
  char* base = nullptr;  // arena: the bucket's storage
  uint64_t ready_ns = 0, launch_ns = 0, start_ns = 0;
};

// A bucket's failure says which step and bucket it was: the first thing to know when a rank died
// or stalled.
void Reducer::BucketTask::run() {
  try {
    if (phase == Phase::All && reducer->rt_[static_cast<size_t>(bucket)]->piece) {
      reducer->pipeline(bucket);
      return;
    }
    if (phase == Phase::All || phase == Phase::In) reducer->stage_in(bucket);
    if (phase == Phase::All || phase == Phase::Collectives) reducer->collectives(bucket, phase == Phase::All);
    if (phase == Phase::All || phase == Phase::Out) reducer->stage_out(bucket);
  } catch (const Error& e) {
    throw Error(e.status(), reducer->where(bucket) + e.what());
  }
}

void Reducer::GatherTask::run() {
  try {
    reducer->gather(bucket, epoch);
  } catch (const Error& e) {
    throw Error(e.status(), reducer->where(bucket) + "parameter gather: " + e.what());
  }
}

Reducer::Reducer(const ReducerEnv& env, const std::vector<GradSpec>& specs) : env_(env), specs_(specs) {
  set_divisor(env_.world);
  const Comm& c = *env_.comms.at(0);
  // Grouping interleaves several buckets' phases on this thread: streams that run tasks inline only.
  can_group_ = c.can_group() && !env_.streams.empty() && env_.streams[0]->runs_inline() && !env_.hook;
  // The streams keep the timeout: a collective of a dead peer never returns on its own.
  for (Stream* s : env_.streams) s->set_task_timeout(env_.timeout_ms);
}

// Scaling (apex): multiply by 1/f before the sum, by f/divisor after it (or not at all without
// averaging); the divisor is the world, or the ranks that contribute (uneven inputs). Fused into the
// collective where the engine can: ncclAvg, a pre-multiplied sum, or a sum the engine scales itself
// (the host ring). A comm hook sums only: both factors stay passes of their own.
void Reducer::set_divisor(int divisor) {
  const Comm& c = *env_.comms.at(0);
  divisor_ = divisor;
  red_ = Reduction{};
  pre_ = 1.0 / env_.predivide;
  post_ = env_.average ? env_.predivide / divisor : 1.0;
  if (env_.hook) {
  } else if (env_.average && env_.predivide == 1.0 && divisor == env_.world && c.supports(RedOp::Avg)) {
    red_ = Reduction{RedOp::Avg, 1.0};
    post_ = 1.0;
  } else if (pre_ != 1.0 && c.supports(RedOp::PreMulSum)) {
    red_ = Reduction{RedOp::PreMulSum, pre_};
    pre_ = 1.0;
  } else if (post_ != 1.0 && c.supports(RedOp::SumScaled)) {
    red_ = Reduction{RedOp::SumScaled, post_};
    post_ = 1.0;
  }
  for (auto& r : rt_) bucket_factors(*r);
}

// A bucket's share of the scaling.
void Reducer::bucket_factors(BucketRt& r) const {
  r.red = red_;
  r.pre = pre_;
  r.post = post_;
  if (r.int8) {  // the int8 wire only sums: both factors are passes (fused into pack and unpack)
    r.red = Reduction{};
    r.pre = 1.0 / env_.predivide;
    r.post = env_.average ? env_.predivide / divisor_ : 1.0;
    return;
  }
  // A premultiplied sum on a 16-bit wire multiplies by the factor in 16 bits: one that 16 bits
  // cannot hold exactly (1/3) would bias every grad. Then it is a pass in fp32 math instead, one
  // rounding per element, as apex's pre-division is.
  if (red_.op == RedOp::PreMulSum && is_16bit(r.wire) && !exact_in(r.wire, red_.factor)) {
    r.red = Reduction{RedOp::Sum, 1.0};
    r.pre = red_.factor;
  }
}

// The device decides whether a buffer can be freed: one written by a collective it had to abandon is
// kept by the backend that could not cancel it.
Reducer::~Reducer() {
  for (void* p : staging_) env_.device->release(p);
  for (void* p : gather_) env_.device->release(p);
  env_.device->release(residual_);
  env_.device->release(arena_);
  env_.device->release(params_);
}

std::string Reducer::where(int b) const {
  return format("iteration %llu, bucket %d of %zu (stream %d): ", static_cast<unsigned long long>(iteration_), b,
                rt_.size(), plan_.buckets[static_cast<size_t>(b)].stream);
}

void Reducer::adopt(Plan plan, const std::vector<void*>& user_ptrs) {
  std::vector<void*> ptrs = user_ptrs;
  char* old_arena = nullptr;
  if (env_.arena) {
    // Storage follows the plan: each bucket one contiguous, 256-byte aligned range of one arena.
    std::vector<size_t> base(plan.buckets.size());
    size_t total = 0;
    for (size_t b = 0; b < plan.buckets.size(); ++b) {
      total = (total + 255) / 256 * 256;
      base[b] = total;
      total += padded_numel(plan.buckets[b]) * dtype_size(plan.buckets[b].dtype);
    }
    char* fresh = static_cast<char*>(env_.device->alloc(total));
    char* fresh_params = env_.shard ? static_cast<char*>(env_.device->alloc(total)) : nullptr;
    for (size_t b = 0; b < plan.buckets.size(); ++b) {
      const Bucket& bk = plan.buckets[b];
      for (size_t s = 0; s < bk.grads.size(); ++s) {
        size_t g = static_cast<size_t>(bk.grads[s]);
        void* to = fresh + base[b] + bk.offsets[s] * dtype_size(bk.dtype);
        const size_t bytes = specs_[g].numel * dtype_size(bk.dtype);
        if (arena_) env_.device->copy(to, grad_ptr(static_cast<int>(g)), bytes);
        if (params_)
          env_.device->copy(fresh_params + (static_cast<char*>(to) - fresh), param_ptr(static_cast<int>(g)), bytes);
        ptrs[g] = to;
      }
    }
    old_arena = arena_;
    arena_ = fresh;
    arena_bytes_ = total;
    env_.device->release(params_);
    params_ = fresh_params;
  }
  plan_ = std::move(plan);
  build_runtime(ptrs);
  env_.device->release(old_arena);
}

// Sharded buckets are padded to a multiple of world shards of a multiple of 256 bytes each, so that
// every shard has the same size and an aligned start.
size_t Reducer::padded_numel(const Bucket& bk) const {
  if (!env_.shard) return bk.numel;
  const size_t unit = static_cast<size_t>(env_.world) * std::max<size_t>(1, 256 / dtype_size(bk.dtype));
  return (bk.numel + unit - 1) / unit * unit;
}

// Bucket b's runtime: its wire type, pieces and factors, and which grads are packed or in place.
std::unique_ptr<Reducer::BucketRt> Reducer::make_bucket(size_t b, const std::vector<void*>& ptrs) const {
  const Bucket& bk = plan_.buckets[b];
  std::unique_ptr<BucketRt> r(new BucketRt());
  r->task.reducer = const_cast<Reducer*>(this);
  r->task.bucket = static_cast<int>(b);
  r->size = static_cast<int>(bk.grads.size());
  Comm& c = *env_.comms[static_cast<size_t>(bk.stream)];
  r->wire = is_16bit(bk.dtype) && (env_.always_fp32 || !c.supports_wire(bk.dtype)) ? Dtype::F32 : bk.dtype;
  if (env_.compress && !is_16bit(bk.dtype)) r->wire = env_.compress_wire;  // every host comm sums 16 bits
  r->int8 = env_.int8 && !is_16bit(bk.dtype);
  if (r->int8) r->int8_chunk = elem::int8_chunk_bytes(bk.numel);
  r->gather_task.reducer = r->task.reducer;
  r->gather_task.bucket = r->task.bucket;
  r->padded = padded_numel(bk);
  r->shard_n = r->padded / static_cast<size_t>(env_.world);
  // Sharded buckets go whole to the comm's reduce-scatter, which cuts its own pieces; a comm hook
  // gets the whole bucket in one buffer.
  r->piece = env_.shard || env_.hook || r->int8 ? 0 : c.piece_elems(r->wire, env_.piece_bytes);
  bucket_factors(*r);
  // inplace_min_numel 0 is the library's choice: on host comms a grad of at least one piece goes
  // in place (its pieces skip the pack and unpack passes: measured faster); elsewhere never.
  const size_t inplace = env_.inplace_min_numel ? env_.inplace_min_numel : r->piece;
  const bool may_direct = !env_.arena && r->wire == bk.dtype && inplace > 0 && !env_.hook && !r->int8;
  for (size_t s = 0; s < bk.grads.size(); ++s) {
    size_t g = static_cast<size_t>(bk.grads[s]);
    const size_t n = specs_[g].numel;
    if (may_direct && n >= inplace) {
      r->direct.segs.push_back(Segment{ptrs[g], 0, n, 0});
      r->where.emplace_back(&r->direct, r->direct.segs.size() - 1);
    } else {
      r->packed.segs.push_back(Segment{ptrs[g], r->packed_numel, n, 0});
      r->where.emplace_back(&r->packed, r->packed.segs.size() - 1);
      r->packed_numel += n;
    }
  }
  if (env_.arena) r->base = static_cast<char*>(ptrs[static_cast<size_t>(bk.grads[0])]);
  return r;
}

void Reducer::build_runtime(const std::vector<void*>& ptrs) {
  const size_t nb = plan_.buckets.size();
  const int ns = static_cast<int>(env_.streams.size());
  std::vector<size_t> staging_need(static_cast<size_t>(ns), 0), gather_need(static_cast<size_t>(ns), 0);
  size_t residuals = 0;
  rt_.clear();
  for (size_t b = 0; b < nb; ++b) {
    const Bucket& bk = plan_.buckets[b];
    std::unique_ptr<BucketRt> r = make_bucket(b, ptrs);
    if (r->int8) {
      r->residual_at = residuals;
      residuals += bk.numel;
      size_t& g = gather_need[static_cast<size_t>(bk.stream)];
      g = std::max(g, r->int8_chunk * static_cast<size_t>(env_.world));
    }
    const bool staged = !env_.arena || r->wire != bk.dtype;
    if (staged) {
      size_t& need = staging_need[static_cast<size_t>(bk.stream)];
      // Sharded: the staging buffer holds the padded bucket (the reduce-scatter's chunks).
      const size_t bytes = (env_.shard ? r->padded : r->packed_numel) * dtype_size(r->wire);
      if (can_group_) {
        // A grouped launch packs every bucket before any collective: each needs its own range.
        r->stage_offset = need;
        need += (bytes + 255) / 256 * 256;
      } else {
        need = std::max(need, bytes);
      }
    }
    rt_.push_back(std::move(r));
  }
  // One staging buffer per stream. Host streams run their buckets one after another, so they share
  // it (as large as the largest bucket); GPU streams may group buckets, so each has its own range.
  for (void* p : staging_) env_.device->release(p);
  staging_.assign(static_cast<size_t>(ns), nullptr);
  staging_bytes_ = 0;
  for (int s = 0; s < ns; ++s) {
    size_t need = staging_need[static_cast<size_t>(s)];
    if (need) staging_[static_cast<size_t>(s)] = env_.device->alloc(need);
    staging_bytes_ += need;
    env_.streams[static_cast<size_t>(s)]->reserve(nb + 1);
  }
  alloc_int8(gather_need, residuals);
  if (env_.check_finite) env_.device->reserve_flags(nb);
  if (env_.shard) env_.device->reserve_marks(nb);
  ready_.assign(specs_.size(), 0);
  zero_.assign(specs_.size(), 0);
  next_ = 0;
}

// The int8 wire's memory: the kept rounding errors of every int8 bucket (zero: nothing owed yet; a
// new plan starts afresh) and one all-gather buffer per stream, as large as its largest bucket needs
// (a host stream runs its buckets one after another).
void Reducer::alloc_int8(const std::vector<size_t>& gather_need, size_t residuals) {
  for (void* p : gather_) env_.device->release(p);
  env_.device->release(residual_);
  gather_.assign(gather_need.size(), nullptr);
  residuals_ = residuals;
  residual_ = residuals ? static_cast<float*>(env_.device->alloc(residuals * sizeof(float))) : nullptr;
  int8_bytes_ = residuals * sizeof(float);
  for (size_t s = 0; s < gather_need.size(); ++s) {
    if (gather_need[s]) gather_[s] = env_.device->alloc(gather_need[s]);
    int8_bytes_ += gather_need[s];
  }
}

void Reducer::clear_feedback() { std::fill_n(residual_, residuals_, 0.0f); }

// The int8 wire: this rank's chunk (its values plus its kept errors, quantized) into its place in the
// stream's gather buffer, every rank's chunk to every rank, and the same rank-order sum everywhere.
void Reducer::int8_allreduce(int b, void* buf, size_t n) {
  auto [r, bk, s, d, c] = work(b);
  char* all = static_cast<char*>(gather_[static_cast<size_t>(bk.stream)]);
  d.int8_quantize(buf, bk.dtype, n, residual_ + r.residual_at, all + static_cast<size_t>(env_.rank) * r.int8_chunk, s);
  c.allgather(all, r.int8_chunk, s, Deadline::after_ms(env_.timeout_ms));
  d.int8_dequant_sum(all, r.int8_chunk, env_.world, n, bk.dtype, buf, s);
}

void* Reducer::staging(int b) const {
  const BucketRt& r = *rt_[static_cast<size_t>(b)];
  return static_cast<char*>(staging_[static_cast<size_t>(plan_.buckets[static_cast<size_t>(b)].stream)]) +
         r.stage_offset;
}

void* Reducer::grad_ptr(int g) const {
  const BucketRt& r = *rt_[static_cast<size_t>(plan_.bucket_of[static_cast<size_t>(g)])];
  auto& w = r.where[static_cast<size_t>(plan_.slot_of[static_cast<size_t>(g)])];
  return w.first->segs[w.second].ptr;
}

void Reducer::set_grad_ptr(int g, void* p) {
  BucketRt& r = *rt_[static_cast<size_t>(plan_.bucket_of[static_cast<size_t>(g)])];
  auto& w = r.where[static_cast<size_t>(plan_.slot_of[static_cast<size_t>(g)])];
  Segment& seg = w.first->segs[w.second];
  if (seg.ptr != p) {
    seg.ptr = p;
    ++w.first->version;
  }
}

void Reducer::set_zero(int g, bool zero) {
  BucketRt& r = *rt_[static_cast<size_t>(plan_.bucket_of[static_cast<size_t>(g)])];
  auto& w = r.where[static_cast<size_t>(plan_.slot_of[static_cast<size_t>(g)])];
  w.first->segs[w.second].zero = zero ? 1u : 0u;
  ++w.first->version;
  zero_[static_cast<size_t>(g)] = zero ? 1 : 0;
}

void Reducer::begin(void* user_stream, uint64_t iteration) {
  std::fill(ready_.begin(), ready_.end(), 0);
  for (auto& r : rt_) r->ready = 0;
  next_ = 0;
  env_.counters->launched.store(0, std::memory_order_relaxed);
  env_.counters->done.store(0, std::memory_order_relaxed);
  env_.counters->buckets.store(static_cast<int32_t>(rt_.size()), std::memory_order_relaxed);
  user_stream_ = user_stream;
  iteration_ = iteration;
}

bool Reducer::mark_ready(int g, bool launch, uint64_t t_ns) {
  char& flag = ready_[static_cast<size_t>(g)];
  if (flag) return false;
  flag = 1;
  if (zero_[static_cast<size_t>(g)]) set_zero(g, false);
  BucketRt& r = *rt_[static_cast<size_t>(plan_.bucket_of[static_cast<size_t>(g)])];
  if (++r.ready == r.size) {
    r.ready_ns = t_ns;
    if (launch) launch_ready_in_order();
  }
  return true;
}

void Reducer::unready_grads(std::vector<int>* out) const {
  out->clear();
  for (size_t g = 0; g < ready_.size(); ++g)
    if (!ready_[g]) out->push_back(static_cast<int>(g));
}

void Reducer::launch_rest() {
  const uint64_t t = now_ns();
  for (size_t g = 0; g < ready_.size(); ++g) {
    if (ready_[g]) continue;
    ready_[g] = 1;
    if (!zero_[g]) set_zero(static_cast<int>(g), true);
    BucketRt& r = *rt_[static_cast<size_t>(plan_.bucket_of[g])];
    if (++r.ready == r.size) r.ready_ns = t;
  }
  launch_ready_in_order();
}

void Reducer::launch_all() {
  const uint64_t t = now_ns();
  for (size_t g = 0; g < ready_.size(); ++g)
    if (!ready_[g]) mark_ready(static_cast<int>(g), false, t);
  launch_ready_in_order();
}

// apex's next_bucket rule: bucket i launches only after every bucket before it, so that every rank
// issues the same collectives in the same order whatever order its grads arrive in.
void Reducer::launch_ready_in_order() {
  const int nb = static_cast<int>(rt_.size());
  const int first = next_;
  while (next_ < nb && rt_[static_cast<size_t>(next_)]->ready == rt_[static_cast<size_t>(next_)]->size) ++next_;
  // Buckets that become ready together go to NCCL as one group (ncclGroupStart/End): one launch of
  // all their collectives. Host streams run each bucket whole on its worker instead.
  env_.counters->launched.store(next_, std::memory_order_relaxed);
  if (next_ - first >= 2 && can_group_) {
    launch_grouped(first, next_);
    return;
  }
  for (int b = first; b < next_; ++b) launch(b);
}

Reducer::Work Reducer::work(int b) {
  const Bucket& bk = plan_.buckets[static_cast<size_t>(b)];
  return Work{*rt_[static_cast<size_t>(b)], bk, stream_of(b), *env_.device,
              *env_.comms[static_cast<size_t>(bk.stream)]};
}

Stream& Reducer::stream_of(int b) {
  return *env_.streams[static_cast<size_t>(plan_.buckets[static_cast<size_t>(b)].stream)];
}

void Reducer::launch(int b) {
  BucketRt& r = *rt_[static_cast<size_t>(b)];
  Stream& s = stream_of(b);
  r.launch_ns = now_ns();
  r.done = false;
  env_.device->stream_wait_user(s, user_stream_);
  s.submit(&r.task);
}

// GPU streams run a task at once on this thread, where it only enqueues: so the phases of several
// buckets can be interleaved: every pack, then every collective inside one group, then every unpack.
// (Inside a group NCCL defers the collectives to the group's end, so an unpack enqueued before the end
// would run before its collective.)
void Reducer::launch_grouped(int first, int last) {
  auto submit = [this](int b, Phase phase) {
    BucketRt& r = *rt_[static_cast<size_t>(b)];
    r.task.phase = phase;
    stream_of(b).submit(&r.task);
    r.task.phase = Phase::All;
  };
  for (int b = first; b < last; ++b) {
    rt_[static_cast<size_t>(b)]->launch_ns = now_ns();
    rt_[static_cast<size_t>(b)]->done = false;
    env_.device->stream_wait_user(stream_of(b), user_stream_);
    submit(b, Phase::In);
  }
  Comm& c = *env_.comms[static_cast<size_t>(plan_.buckets[static_cast<size_t>(first)].stream)];
  c.group_start();
  try {
    for (int b = first; b < last; ++b) submit(b, Phase::Collectives);
  } catch (...) {
    try {
      c.group_end();
    } catch (...) {
    }
    throw;
  }
  c.group_end();
  for (int b = first; b < last; ++b) submit(b, Phase::Out);
}

// Packed path (copy layout, or 16-bit buckets the engine cannot sum): one pass in, casting and
// pre-scaling. Arena path: zeros for unused grads, and the pre-scale in place if the engine cannot fuse it.
void Reducer::stage_in(int b) {
  auto [r, bk, s, d, c] = work(b);
  r.start_ns = now_ns();
  if (!env_.arena || r.wire != bk.dtype) {
    if (!r.packed.segs.empty()) d.pack(r.packed, bk.dtype, staging(b), r.wire, r.pre, Span{0, r.packed_numel}, s);
    for (Segment& seg : r.direct.segs) {
      if (seg.zero)
        d.fill_zero(seg.ptr, seg.numel, bk.dtype, s);
      else
        d.scale(seg.ptr, seg.numel, bk.dtype, r.pre, s);
    }
  } else {
    for (Segment& seg : r.packed.segs)
      if (seg.zero) d.fill_zero(seg.ptr, seg.numel, bk.dtype, s);
    d.scale(r.base, bk.numel, bk.dtype, r.pre, s);
  }
}

// The bucket's collectives: the packed buffer and each in-place grad, as one group when several (and
// `own_group`: a grouped launch already brackets them).
void Reducer::collectives(int b, bool own_group) {
  auto [r, bk, s, d, c] = work(b);
  const Deadline dl = Deadline::after_ms(env_.timeout_ms);
  if (env_.hook) {  // the caller's reduction of the whole bucket (never sharded, never in place)
    const bool staged = !env_.arena || r.wire != bk.dtype;
    env_.hook(HookCall{b, bk.stream, iteration_, staged ? staging(b) : r.base, staged ? r.packed_numel : bk.numel,
                       r.wire, &s, &c, dl});
    return;
  }
  if (r.int8) {
    const bool staged = !env_.arena;
    int8_allreduce(b, staged ? staging(b) : r.base, staged ? r.packed_numel : bk.numel);
    return;
  }
  if (env_.arena && r.wire == bk.dtype) {
    if (env_.shard)
      c.reduce_scatter(r.base, r.shard_n, bk.dtype, r.red, s, dl);
    else
      c.allreduce(r.base, r.base, bk.numel, bk.dtype, r.red, s, dl);
    return;
  }
  const bool packed = !r.packed.segs.empty();
  const bool group = own_group && (packed ? 1u : 0u) + r.direct.segs.size() > 1;
  if (group) c.group_start();
  void* st = staging(b);
  if (packed && env_.shard)
    c.reduce_scatter(st, r.shard_n, r.wire, r.red, s, dl);
  else if (packed)
    c.allreduce(st, st, r.packed_numel, r.wire, r.red, s, dl);
  for (Segment& seg : r.direct.segs) c.allreduce(seg.ptr, seg.ptr, seg.numel, bk.dtype, r.red, s, dl);
  if (group) c.group_end();
}

// One pass out (post-scale, cast back), the optional finiteness scan, and the bucket's accounting.
void Reducer::stage_out(int b) {
  auto [r, bk, s, d, c] = work(b);
  if (!env_.arena || r.wire != bk.dtype) {
    if (!r.packed.segs.empty()) d.unpack(staging(b), r.wire, r.packed, bk.dtype, r.post, Span{0, r.packed_numel}, s);
    for (Segment& seg : r.direct.segs) d.scale(seg.ptr, seg.numel, bk.dtype, r.post, s);
    // Sharded: the whole staging buffer goes back (outside the shard the values are unspecified
    // anyway), but only the shard is scanned.
    const size_t lo = env_.shard ? std::min(r.packed_numel, static_cast<size_t>(env_.rank) * r.shard_n) : 0;
    const size_t hi = env_.shard ? std::min(r.packed_numel, lo + r.shard_n) : r.packed_numel;
    size_t cursor = 0;
    scan_packed(b, Span{lo, hi}, &cursor);
    for (const Segment& seg : r.direct.segs) scan(b, seg.ptr, seg.numel);
  } else if (env_.shard) {
    char* mine = r.base + static_cast<size_t>(env_.rank) * r.shard_n * dtype_size(bk.dtype);
    d.scale(mine, r.shard_n, bk.dtype, r.post, s);
    scan(b, mine, r.shard_n);
  } else {
    d.scale(r.base, bk.numel, bk.dtype, r.post, s);
    scan(b, r.base, bk.numel);
  }
  account(b);
}

void Reducer::scan(int b, const void* p, size_t n) {
  const Bucket& bk = plan_.buckets[static_cast<size_t>(b)];
  if (env_.check_finite) env_.device->scan_nonfinite(p, n, bk.dtype, static_cast<size_t>(b), stream_of(b));
}

// Scans the grads (in their own dtype: a cast back to 16 bits can overflow) that the packed elements
// `span` went back to. Spans come in increasing order; *cursor is the first segment not yet passed.
void Reducer::scan_packed(int b, Span span, size_t* cursor) {
  if (!env_.check_finite) return;
  const BucketRt& r = *rt_[static_cast<size_t>(b)];
  const size_t es = dtype_size(plan_.buckets[static_cast<size_t>(b)].dtype);
  for (size_t i = *cursor; i < r.packed.segs.size(); ++i) {
    const Segment& seg = r.packed.segs[i];
    if (seg.offset >= span.hi) break;
    const size_t a = std::max(span.lo, seg.offset), e = std::min(span.hi, seg.offset + seg.numel);
    if (a < e) scan(b, static_cast<const char*>(seg.ptr) + (a - seg.offset) * es, e - a);
    if (seg.offset + seg.numel <= span.hi) *cursor = i + 1;
  }
}

void Reducer::account(int b) {
  BucketRt& r = *rt_[static_cast<size_t>(b)];
  const Bucket& bk = plan_.buckets[static_cast<size_t>(b)];
  uint64_t bytes = 0;
  if (r.int8) {
    bytes = r.int8_chunk;
  } else if (!env_.arena || r.wire != bk.dtype) {
    bytes = (env_.shard ? r.padded : r.packed_numel) * dtype_size(r.wire);
    for (const Segment& seg : r.direct.segs) bytes += seg.numel * dtype_size(bk.dtype);
  } else {
    bytes = r.padded * dtype_size(bk.dtype);
  }
  const uint64_t t1 = now_ns();
  Counters& k = *env_.counters;
  k.buckets_reduced.fetch_add(1, std::memory_order_relaxed);
  k.done.fetch_add(1, std::memory_order_relaxed);
  k.bytes_reduced.fetch_add(bytes, std::memory_order_relaxed);
  if (!stream_of(b).runs_inline()) k.comm_time_ns.fetch_add(t1 - r.launch_ns, std::memory_order_relaxed);
  if (env_.timeline)
    env_.timeline->bucket(b, bk.stream, iteration_, r.ready_ns, r.launch_ns, r.start_ns, t1, r.size, bytes);
  r.done = true;
}

// Host pieces: each piece goes in (pack, or the pre-scale), through its collective and out (unpack
// or the post-scale, the finiteness scan) before the next one, so every pass but the collective's
// own touches data still in cache: no whole-bucket pass before or after the collective.
void Reducer::pipeline(int b) {
  auto [r, bk, s, d, c] = work(b);
  r.start_ns = now_ns();
  if (env_.arena && r.wire == bk.dtype) {
    for (Segment& seg : r.packed.segs)
      if (seg.zero) d.fill_zero(seg.ptr, seg.numel, bk.dtype, s);
    reduce_in_place(b, r.base, bk.numel);
  } else {
    char* st = static_cast<char*>(staging(b));
    const size_t ws = dtype_size(r.wire);
    const Deadline dl = Deadline::after_ms(env_.timeout_ms);
    size_t cursor = 0, walk = 0;
    for (size_t lo = 0; lo < r.packed_numel; lo += r.piece) {
      const Span sp{lo, std::min(r.packed_numel, lo + r.piece)};
      const void* from = direct_source(r, bk.dtype, sp, &walk);
      if (!from) {
        d.pack(r.packed, bk.dtype, st, r.wire, r.pre, sp, s);
        from = st + lo * ws;
      }
      c.allreduce(from, st + lo * ws, sp.hi - lo, r.wire, r.red, s, dl);
      d.unpack(st, r.wire, r.packed, bk.dtype, r.post, sp, s);
      scan_packed(b, sp, &cursor);
    }
    for (Segment& seg : r.direct.segs) {
      if (seg.zero) d.fill_zero(seg.ptr, seg.numel, bk.dtype, s);
      reduce_in_place(b, seg.ptr, seg.numel);
    }
  }
  account(b);
}

// Where a packed piece can be sent from without packing it: inside one used grad, when the pack
// would neither cast nor scale. The collective then reads the grad and writes the staging buffer,
// and the unpack brings the sum back: one pass fewer. Not when the caller forbade collectives on its
// grads (inplace_min_numel SIZE_MAX). *seg walks the segments as the spans advance.
const void* Reducer::direct_source(const BucketRt& r, Dtype dtype, Span sp, size_t* seg) const {
  if (r.wire != dtype || r.pre != 1.0 || env_.inplace_min_numel == SIZE_MAX) return nullptr;
  const std::vector<Segment>& segs = r.packed.segs;
  while (*seg < segs.size() && segs[*seg].offset + segs[*seg].numel <= sp.lo) ++*seg;
  if (*seg == segs.size()) return nullptr;
  const Segment& g = segs[*seg];
  if (g.zero || g.offset > sp.lo || g.offset + g.numel < sp.hi) return nullptr;
  return static_cast<const char*>(g.ptr) + (sp.lo - g.offset) * dtype_size(dtype);
}

// An in-place range (an arena bucket, a grad reduced in place) in pieces, each scaled before and
// after its collective while in cache.
void Reducer::reduce_in_place(int b, void* p, size_t n) {
  auto [r, bk, s, d, c] = work(b);
  const size_t es = dtype_size(bk.dtype);
  const Deadline dl = Deadline::after_ms(env_.timeout_ms);
  for (size_t lo = 0; lo < n; lo += r.piece) {
    char* at = static_cast<char*>(p) + lo * es;
    const size_t k = std::min(r.piece, n - lo);
    d.scale(at, k, bk.dtype, r.pre, s);
    c.allreduce(at, at, k, bk.dtype, r.red, s, dl);
    d.scale(at, k, bk.dtype, r.post, s);
    scan(b, at, k);
  }
}

// Host streams: the host waits (each stream keeps the timeout of its blocked collectives). GPU
// streams: the user's stream waits. Then the finiteness flags, where the host waited anyway.
void Reducer::finish(void* user_stream, Deadline dl) {
  std::exception_ptr first;
  for (size_t i = 0; i < env_.streams.size(); ++i) {
    Stream& s = *env_.streams[i];
    try {
      if (s.runs_inline()) {
        env_.device->user_wait_stream(user_stream, s);
        s.poll_error();
      } else {
        s.drain(dl);
      }
    } catch (const Error& e) {
      // A task's own error names its bucket already; the stream's timeout does not.
      const bool named = std::strncmp(e.what(), "iteration ", 10) == 0;
      if (!first)
        first = std::make_exception_ptr(
            e.status() == DDP_ERR_TIMEOUT && !named ? Error(e.status(), stuck(static_cast<int>(i)) + e.what()) : e);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
  if (next_ != static_cast<int>(rt_.size()))
    fail(DDP_ERR_INTERNAL, "epilogue: %d of %zu buckets were launched", next_, rt_.size());
  if (!env_.check_finite) return;
  for (int b = 0; b < next_; ++b)
    if (env_.device->take_nonfinite(static_cast<size_t>(b), stream_of(b)))
      env_.counters->nonfinite_buckets.fetch_add(1, std::memory_order_relaxed);
}

// Where stream `si` stands: its first launched bucket that has not finished (a task that timed out
// in the stream's drain names no bucket itself).
std::string Reducer::stuck(int si) const {
  for (int b = 0; b < next_; ++b)
    if (plan_.buckets[static_cast<size_t>(b)].stream == si && !rt_[static_cast<size_t>(b)]->done) return where(b);
  return format("iteration %llu, stream %d: ", static_cast<unsigned long long>(iteration_), si);
}

// ---------------------------------------------------------------------------------------------
// Sharded contexts
// ---------------------------------------------------------------------------------------------

Reducer::ShardView Reducer::shard(int b) const {
  const BucketRt& r = *rt_[static_cast<size_t>(b)];
  const Bucket& bk = plan_.buckets[static_cast<size_t>(b)];
  ShardView v;
  v.dtype = bk.dtype;
  v.padded = r.padded;
  v.shard_n = r.shard_n;
  v.lo = static_cast<size_t>(env_.rank) * r.shard_n;
  v.numel = bk.numel;
  v.arena_byte = static_cast<size_t>(r.base - arena_) + v.lo * dtype_size(bk.dtype);
  v.grad = arena_ + v.arena_byte;
  v.param = params_ ? params_ + v.arena_byte : nullptr;
  return v;
}

void* Reducer::param_ptr(int g) const { return params_ + (static_cast<char*>(grad_ptr(g)) - arena_); }

void Reducer::gather(int b, uint64_t epoch) {
  auto [r, bk, s, d, c] = work(b);
  c.allgather(params_ + (r.base - arena_), r.shard_n * dtype_size(bk.dtype), s, gather_deadline_);
  if (s.runs_inline()) d.mark(static_cast<size_t>(b), s);
  r.gathered.store(epoch, std::memory_order_release);
}

// In the order a forward pass needs the parameters: the plan's buckets follow backward's order, so
// its last bucket holds the first layers.
void Reducer::launch_gather(void* user_stream) {
  ++gather_epoch_;
  gather_deadline_ = Deadline::after_ms(env_.timeout_ms);
  for (Stream* s : env_.streams) env_.device->stream_wait_user(*s, user_stream);
  for (size_t b = rt_.size(); b-- > 0;) {
    GatherTask& t = rt_[b]->gather_task;
    t.epoch = gather_epoch_;
    stream_of(static_cast<int>(b)).submit(&t);
  }
}

void Reducer::wait_gathered(int b, void* user_stream) {
  BucketRt& r = *rt_[static_cast<size_t>(b)];
  Stream& s = stream_of(b);
  if (s.runs_inline()) {
    env_.device->user_wait_mark(user_stream, static_cast<size_t>(b));
    s.poll_error();
    return;
  }
  for (unsigned spin = 0; r.gathered.load(std::memory_order_acquire) < gather_epoch_; ++spin) {
    s.poll_error();
    if (gather_deadline_.passed())
      fail(DDP_ERR_TIMEOUT,
           "%sthe parameter gather did not complete before the timeout: another rank stalled, died or "
           "issued a different collective",
           where(b).c_str());
    if (spin < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(spin < 4096 ? 20 : 500));
  }
}

void Reducer::shard_norm_terms(void* user_stream, double out[2]) {
  for (Stream* s : env_.streams) env_.device->stream_wait_user(*s, user_stream);
  for (size_t b = 0; b < rt_.size(); ++b) {
    const ShardView v = shard(static_cast<int>(b));
    env_.device->norm_terms(v.grad, v.shard_n, v.dtype, stream_of(static_cast<int>(b)), out);
  }
}

Dtype Reducer::wire(int b) const { return rt_[static_cast<size_t>(b)]->wire; }

void Reducer::cancel() {
  for (Stream* s : env_.streams) s->cancel();
}

}  // namespace ddp
