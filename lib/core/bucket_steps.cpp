// A launched bucket's work: its program's steps (in: pack or pre-scale; the collectives; out: unpack
// or post-scale, the finiteness scan, the accounting), or, on host memory, the whole bucket in
// pieces with every pass fused into each piece. Every failure names the bucket and the step.
#include <algorithm>
#include <cstring>

#include "core/bucket_runtime.hpp"

namespace ddp {

namespace {
// A bucket's allreduce: f32 elements whose bytes travel in 16 bits cast inside the host ring
// (BucketProgram::ring_cast), anything else as the comm's plain allreduce.
void allreduce(const BucketProgram& p, Comm& c, Stream& s, const void* from, void* to, size_t n, Dtype d, Deadline dl) {
  if (p.ring_cast)
    c.allreduce_as(from, to, n, d, p.send, p.red, s, dl);
  else
    c.allreduce(from, to, n, d, p.red, s, dl);
}
}  // namespace

// A bucket's failure says which step and bucket it was: the first thing to know when a rank died
// or stalled.
void Reducer::run_step(int b, Step step) {
  try {
    switch (step) {
      case Step::Whole:
        if (program_.buckets[static_cast<size_t>(b)].piece) {
          pieces(b);
          return;
        }
        step_in(b);
        step_collectives(b, true);
        step_out(b);
        return;
      case Step::In: return step_in(b);
      case Step::Collectives: return step_collectives(b, false);
      case Step::Out: return step_out(b);
    }
  } catch (const Error& e) {
    const ddp_status_t st = e.status();
    if (env_.on_failure && (st == DDP_ERR_TIMEOUT || st == DDP_ERR_ABORTED || st == DDP_ERR_NCCL)) env_.on_failure();
    throw Error(e.status(), where(b) + e.what());
  }
}

// (The arena's unused grads were zeroed by step_in.)
SegmentTable& Reducer::grads_table(const BucketProgram& p, BucketRt& r, void* buf, size_t n, SegmentTable* arena) {
  if (p.staged) return r.packed;
  arena->segs.assign(1, Segment{buf, 0, n, 0});
  return *arena;
}

// Staged: one pass in, casting and pre-scaling into the staging buffer (in-place grads: their zeros or
// pre-scale). In place (arena): zeros for unused grads, and the pre-scale if the engine cannot fuse it.
void Reducer::step_in(int b) {
  auto [p, r, s, d, c] = work(b);
  r.start_ns = now_ns();
  if (int8_reads_grads(p)) {
    if (!p.staged)
      for (Segment& seg : r.packed.segs)
        if (seg.zero) d.fill_zero(seg.ptr, seg.numel, p.dtype, s);
    return;
  }
  if (p.staged) {
    if (!r.packed.segs.empty()) d.pack(r.packed, p.dtype, staging(b), p.wire, p.pre, Span{0, p.packed}, s);
    for (Segment& seg : r.direct.segs) {
      if (seg.zero)
        d.fill_zero(seg.ptr, seg.numel, p.dtype, s);
      else
        d.scale(seg.ptr, seg.numel, p.dtype, p.pre, s);
    }
  } else {
    for (Segment& seg : r.packed.segs)
      if (seg.zero) d.fill_zero(seg.ptr, seg.numel, p.dtype, s);
    d.scale(r.base, p.numel, p.dtype, p.pre, s);
  }
}

// The bucket's collectives: its buffer, and each in-place grad, as one group when several (and
// `own_group`: a grouped launch already brackets them).
void Reducer::step_collectives(int b, bool own_group) {
  auto [p, r, s, d, c] = work(b);
  const Deadline dl = Deadline::after_ms(env_.timeout_ms);
  void* buf = buffer(b);
  const size_t n = p.staged ? p.packed : p.numel;
  switch (p.collective) {
    case Collective::Hook:  // the caller's reduction of the whole bucket (never sharded, never in place)
      // The user's function runs as a blocking call on `s` (ddp_set_comm_hook's wrapper), bounded by
      // timeout_ms like a blocked collective.
      return env_.hook(HookCall{b, p.stream, iteration_, buf, n, p.wire, &s, &c, dl});
    case Collective::Int8: {
      SegmentTable arena;
      return int8_.allreduce(b, p, grads_table(p, r, buf, n, &arena), buf, n, s, c);
    }
    case Collective::ReduceScatter: return c.reduce_scatter(buf, p.shard_n, p.wire, p.red, s, dl);
    case Collective::AllReduce: break;
  }
  const bool packed = !p.staged || !r.packed.segs.empty();
  const bool group = own_group && (packed ? 1u : 0u) + r.direct.segs.size() > 1;
  if (group) c.group_start();
  if (packed) allreduce(p, c, s, buf, buf, n, p.wire, dl);
  for (Segment& seg : r.direct.segs) allreduce(p, c, s, seg.ptr, seg.ptr, seg.numel, p.dtype, dl);
  if (group) c.group_end();
}

// One pass out (unpack or the post-scale of the program's out span), the optional finiteness scan,
// and the bucket's accounting.
void Reducer::step_out(int b) {
  auto [p, r, s, d, c] = work(b);
  if (p.staged) {
    // Sharded: the whole staging buffer goes back (outside the shard the values are unspecified
    // anyway), but only the shard is scanned. The int8 rounds and scatter wrote the grads already.
    if (!r.packed.segs.empty() && !int8_reads_grads(p))
      d.unpack(staging(b), p.wire, r.packed, p.dtype, p.post, Span{0, p.packed}, s);
    for (Segment& seg : r.direct.segs) d.scale(seg.ptr, seg.numel, p.dtype, p.post, s);
    size_t cursor = 0;
    scan_packed(b, p.out, &cursor);
    for (const Segment& seg : r.direct.segs) scan(b, seg.ptr, seg.numel);
  } else {
    char* mine = r.base + p.out.lo * dtype_size(p.dtype);
    if (!int8_reads_grads(p)) d.scale(mine, p.out.hi - p.out.lo, p.dtype, p.post, s);
    scan(b, mine, p.out.hi - p.out.lo);
  }
  account(b);
}

void Reducer::scan(int b, const void* p, size_t n) {
  if (env_.check_finite)
    env_.device->scan_nonfinite(p, n, program_.buckets[static_cast<size_t>(b)].dtype, static_cast<size_t>(b),
                                stream_of(b));
}

// Scans the grads (in their own dtype: a cast back to 16 bits can overflow) that the packed elements
// `span` went back to. Spans come in increasing order; *cursor is the first segment not yet passed.
void Reducer::scan_packed(int b, Span span, size_t* cursor) {
  if (!env_.check_finite) return;
  const BucketRt& r = *rt_[static_cast<size_t>(b)];
  const size_t es = dtype_size(program_.buckets[static_cast<size_t>(b)].dtype);
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
  const BucketProgram& p = program_.buckets[static_cast<size_t>(b)];
  const uint64_t t1 = now_ns();
  Stats& k = *env_.stats;
  k.buckets_reduced.fetch_add(1, std::memory_order_relaxed);
  // GPU streams only enqueued the work: they count the bucket done when it completes.
  const bool later = !workers_ && stream_of(b).finishes_later(b, &env_.progress->done);
  if (!later) env_.progress->done.fetch_add(1, std::memory_order_relaxed);
  k.bytes_reduced.fetch_add(p.wire_bytes, std::memory_order_relaxed);
  if (workers_) k.comm_time_ns.fetch_add(t1 - r.launch_ns, std::memory_order_relaxed);
  if (env_.timeline)
    env_.timeline->bucket(b, p.stream, iteration_, r.ready_ns, r.launch_ns, r.start_ns, t1, r.size, p.wire_bytes);
  r.done = !later;
}

// Host pieces: each piece goes in (pack, or the pre-scale), through its collective and out (unpack
// or the post-scale, the finiteness scan) before the next one, so every pass but the collective's
// own touches data still in cache: no whole-bucket pass before or after the collective.
void Reducer::pieces(int b) {
  auto [p, r, s, d, c] = work(b);
  r.start_ns = now_ns();
  if (!p.staged) {
    for (Segment& seg : r.packed.segs)
      if (seg.zero) d.fill_zero(seg.ptr, seg.numel, p.dtype, s);
    reduce_in_place(b, r.base, p.numel);
  } else {
    char* st = static_cast<char*>(staging(b));
    const size_t ws = dtype_size(p.wire);
    const Deadline dl = Deadline::after_ms(env_.timeout_ms);
    size_t cursor = 0, walk = 0;
    for (size_t lo = 0; lo < p.packed; lo += p.piece) {
      const Span sp{lo, std::min(p.packed, lo + p.piece)};
      const void* from = direct_source(p, r, sp, &walk);
      if (!from) {
        d.pack(r.packed, p.dtype, st, p.wire, p.pre, sp, s);
        from = st + lo * ws;
      }
      allreduce(p, c, s, from, st + lo * ws, sp.hi - lo, p.wire, dl);
      d.unpack(st, p.wire, r.packed, p.dtype, p.post, sp, s);
      scan_packed(b, sp, &cursor);
    }
    for (Segment& seg : r.direct.segs) {
      if (seg.zero) d.fill_zero(seg.ptr, seg.numel, p.dtype, s);
      reduce_in_place(b, seg.ptr, seg.numel);
    }
  }
  account(b);
}

// Where a packed piece can be sent from without packing it: inside one used grad, when the pack
// would neither cast nor scale. The collective then reads the grad and writes the staging buffer,
// and the unpack brings the sum back: one pass fewer. Not when the caller forbade collectives on its
// grads (inplace_min_numel SIZE_MAX). *seg walks the segments as the spans advance.
const void* Reducer::direct_source(const BucketProgram& p, const BucketRt& r, Span sp, size_t* seg) const {
  if (p.wire != p.dtype || p.pre != 1.0 || env_.program.inplace_min_numel == SIZE_MAX) return nullptr;
  const std::vector<Segment>& segs = r.packed.segs;
  while (*seg < segs.size() && segs[*seg].offset + segs[*seg].numel <= sp.lo) ++*seg;
  if (*seg == segs.size()) return nullptr;
  const Segment& g = segs[*seg];
  if (g.zero || g.offset > sp.lo || g.offset + g.numel < sp.hi) return nullptr;
  return static_cast<const char*>(g.ptr) + (sp.lo - g.offset) * dtype_size(p.dtype);
}

// An in-place range (an arena bucket, a grad reduced in place) in pieces, each scaled before and
// after its collective while in cache.
void Reducer::reduce_in_place(int b, void* ptr, size_t n) {
  auto [p, r, s, d, c] = work(b);
  const size_t es = dtype_size(p.dtype);
  const Deadline dl = Deadline::after_ms(env_.timeout_ms);
  for (size_t lo = 0; lo < n; lo += p.piece) {
    char* at = static_cast<char*>(ptr) + lo * es;
    const size_t k = std::min(p.piece, n - lo);
    d.scale(at, k, p.dtype, p.pre, s);
    allreduce(p, c, s, at, at, k, p.dtype, dl);
    d.scale(at, k, p.dtype, p.post, s);
    scan(b, at, k);
  }
}
}  // namespace ddp
