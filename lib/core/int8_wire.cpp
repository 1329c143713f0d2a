#include "core/int8_wire.hpp"

#include <algorithm>

#include "kernels/elementwise.h"

namespace ddp {

Int8Wire::~Int8Wire() { release(); }

// The device decides whether a buffer can be freed: one written by a collective it had to abandon is
// kept by the backend that could not cancel it.
void Int8Wire::release() {
  for (void* p : exchange_) device_.release(p);
  exchange_.clear();
  device_.release(residual_);
  residual_ = nullptr;
}

// A host stream runs its buckets one after another, so one exchange buffer per stream serves them
// all: world chunks to all-gather (two rounds' worth when it goes in rounds), or (scatter) world
// shards to send and world to receive.
void Int8Wire::adopt(const Program& program, size_t num_streams) {
  const size_t nb = program.buckets.size();
  residual_at_.assign(nb, 0);
  shard_residual_at_.assign(nb, 0);
  size_t residuals = 0;
  std::vector<size_t> need(num_streams, 0);
  for (size_t b = 0; b < nb; ++b) {
    const BucketProgram& p = program.buckets[b];
    if (p.collective != Collective::Int8) continue;
    residual_at_[b] = residuals;
    residuals += p.numel;
    if (p.int8_scatter) {
      const Span mine = int8_shard(p.numel, settings_.world, settings_.rank);
      shard_residual_at_[b] = residuals;
      residuals += mine.hi - mine.lo;
    }
    size_t& n = need[static_cast<size_t>(p.stream)];
    n = std::max(n, p.int8_chunk * static_cast<size_t>(settings_.world) * (p.int8_scatter || p.int8_piece ? 2 : 1));
  }
  release();
  residual_ = residuals ? static_cast<float*>(device_.alloc(residuals * sizeof(float))) : nullptr;
  bytes_ = residuals * sizeof(float);
  exchange_.assign(num_streams, nullptr);
  for (size_t s = 0; s < num_streams; ++s) {
    if (need[s]) exchange_[s] = device_.alloc(need[s]);
    bytes_ += need[s];
  }
}

size_t Int8Wire::stage_bytes(const BucketProgram& p) const {
  if (!p.staged || !reads_grads(p, device_.memory())) return p.stage_bytes;
  if (!p.int8_scatter) return 0;
  const Span mine = int8_shard(p.numel, settings_.world, settings_.rank);
  return (mine.hi - mine.lo) * dtype_size(p.dtype);
}

void Int8Wire::allreduce(int b, const BucketProgram& p, SegmentTable& grads, void* buf, size_t n, Stream& s, Comm& c) {
  const size_t k = static_cast<size_t>(b);
  if (p.int8_scatter) return scatter(p, k, grads, buf, n, s, c);
  if (p.int8_piece) return gather_rounds(p, k, grads, n, s, c);
  gather(p, k, buf, n, s, c);
}

// This rank's chunk (its values plus its kept errors, quantized) into its place in the stream's
// exchange buffer, every rank's chunk to every rank, and the same rank-order sum everywhere.
void Int8Wire::gather(const BucketProgram& p, size_t b, void* buf, size_t n, Stream& s, Comm& c) {
  char* all = static_cast<char*>(exchange_[static_cast<size_t>(p.stream)]);
  device_.int8_quantize(buf, p.dtype, n, residual_ + residual_at_[b],
                        all + static_cast<size_t>(settings_.rank) * p.int8_chunk, s);
  c.allgather(all, p.int8_chunk, s, Deadline::after_ms(timeout_ms_));
  device_.int8_dequant_sum(all, p.int8_chunk, settings_.world, n, p.dtype, buf, s);
}

// The all-gather in rounds of p.int8_piece elements (whole blocks, so the bits are those of the
// whole bucket's): round k's chunks in one of two halves of the stream's buffer, alternately, so
// that the comm can quantize round k + 1 and sum round k - 1 while round k is on the wire. Each round
// quantizes straight from the grads (copy layout) or the arena, pre-scaled on the way, and sums
// straight into them, post-scaled on the way, a cache-sized tile at a time
// (Device::int8_quantize_grads): the passes the in and out steps leave to it cost no memory pass.
void Int8Wire::gather_rounds(const BucketProgram& p, size_t b, SegmentTable& grads, size_t n, Stream& s, Comm& c) {
  struct Rounds final : AllgatherRounds {
    Device* d;
    Stream* s;
    const BucketProgram* p;
    SegmentTable* table;
    char* all;
    float* residual;
    size_t n;
    int world, rank;
    size_t count() override { return (n + p->int8_piece - 1) / p->int8_piece; }
    char* buffer(size_t k) override { return all + (k % 2) * p->int8_chunk * static_cast<size_t>(world); }
    size_t bytes(size_t k) override { return elem::int8_chunk_bytes(len(k)); }
    size_t len(size_t k) const { return std::min(p->int8_piece, n - k * p->int8_piece); }
    Span span(size_t k) const { return Span{k * p->int8_piece, k * p->int8_piece + len(k)}; }
    void fill(size_t k) override {
      d->int8_quantize_grads(*table, p->dtype, p->pre, span(k), residual + span(k).lo,
                             buffer(k) + static_cast<size_t>(rank) * bytes(k), *s);
    }
    void done(size_t k) override {
      d->int8_dequant_grads(buffer(k), bytes(k), world, span(k), *table, p->dtype, p->post, *s);
    }
  };
  Rounds rounds;
  rounds.d = &device_;
  rounds.s = &s;
  rounds.p = &p;
  rounds.table = &grads;
  rounds.all = static_cast<char*>(exchange_[static_cast<size_t>(p.stream)]);
  rounds.residual = residual_ + residual_at_[b];
  rounds.n = n;
  rounds.world = settings_.world;
  rounds.rank = settings_.rank;
  c.allgather_rounds(rounds, s, Deadline::after_ms(timeout_ms_));
}

// The reduce-scatter: the bucket is cut into world shards of whole blocks (int8_shard); each rank
// quantizes every shard with its kept errors (the same blocks, the same bits as the all-gather's
// chunk), sends shard j to rank j, sums the world chunks of its own shard in rank order,
// re-quantizes that sum with errors kept for it, and all-gathers the re-quantized shards, which every
// rank (the owner too) dequantizes: the same bits everywhere. Each exchange moves (world - 1) shard
// chunks each way, so the bytes stay about a quarter of fp32's ring at any world size.
void Int8Wire::scatter(const BucketProgram& p, size_t b, SegmentTable& grads, void* buf, size_t n, Stream& s, Comm& c) {
  const int world = settings_.world, me = settings_.rank;
  const size_t es = dtype_size(p.dtype), chunk = p.int8_chunk;
  const bool direct = reads_grads(p, device_.memory());  // else the in step packed (or scaled) into buf
  char* x = static_cast<char*>(buf);
  char* send = static_cast<char*>(exchange_[static_cast<size_t>(p.stream)]);
  char* recv = send + static_cast<size_t>(world) * chunk;
  const Deadline dl = Deadline::after_ms(timeout_ms_);
  for (int j = 0; j < world; ++j) {
    const Span sh = int8_shard(n, world, j);
    float* res = residual_ + residual_at_[b] + sh.lo;
    char* to = send + static_cast<size_t>(j) * chunk;
    if (direct)
      device_.int8_quantize_grads(grads, p.dtype, p.pre, sh, res, to, s);
    else
      device_.int8_quantize(x + sh.lo * es, p.dtype, sh.hi - sh.lo, res, to, s);
  }
  c.alltoall(send, recv, chunk, s, dl);
  // The shard's sum, before its re-quantization, in the bucket's buffer, which no quantization reads
  // any more: the arena at the shard's place, the staging buffer (which holds nothing else: the grads
  // are read and written where they lie) from its start, or at the shard's place where it was packed.
  const Span mine = int8_shard(n, world, me);
  char* own = direct && p.staged ? x : x + mine.lo * es;
  device_.int8_dequant_sum(recv, chunk, world, mine.hi - mine.lo, p.dtype, own, s);
  device_.int8_quantize(own, p.dtype, mine.hi - mine.lo, residual_ + shard_residual_at_[b],
                        send + static_cast<size_t>(me) * chunk, s);
  c.allgather(send, chunk, s, dl);
  for (int j = 0; j < world; ++j) {
    const Span sh = int8_shard(n, world, j);
    const char* from = send + static_cast<size_t>(j) * chunk;
    if (direct)
      device_.int8_dequant_grads(from, chunk, 1, sh, grads, p.dtype, p.post, s);
    else
      device_.int8_dequant_sum(from, chunk, 1, sh.hi - sh.lo, p.dtype, x + sh.lo * es, s);
  }
}

}  // namespace ddp
