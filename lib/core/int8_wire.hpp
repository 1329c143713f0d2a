// The int8 wire (DDP_COMPRESS_INT8) of a reducer: what it keeps between iterations (every int8
// bucket's rounding errors, error feedback) and the three ways an int8 bucket crosses the ranks: the
// all-gather of every rank's quantized chunk, the same all-gather in rounds (host memory, large
// buckets: quantized from and summed into the grads a tile at a time), and the reduce-scatter (from
// 3 ranks: each rank sums and re-quantizes one shard). The element code is kernels/elementwise.h's,
// the same on the host and the GPU; the error bound is the header's (include/ddp.h).
#pragma once

#include <cstdint>
#include <vector>

#include "core/backend.hpp"
#include "core/program.hpp"

namespace ddp {

class Int8Wire {
 public:
  Int8Wire(Device& device, const ProgramSettings& settings, int64_t timeout_ms)
      : device_(device), settings_(settings), timeout_ms_(timeout_ms) {}
  ~Int8Wire();
  Int8Wire(const Int8Wire&) = delete;
  Int8Wire& operator=(const Int8Wire&) = delete;

  // Lays out the kept errors of `program`'s int8 buckets (zero: a new plan owes nothing) and one
  // exchange buffer per stream, as large as its largest int8 bucket needs.
  void adopt(const Program& program, size_t num_streams);
  // Forgets every kept error, each bucket in its stream's order (`stream_of(b)`): a rank that joins
  // contributes zeros from then on.
  template <class StreamOf>
  void clear(const Program& program, StreamOf stream_of) {
    for (size_t b = 0; b < program.buckets.size(); ++b)
      if (program.buckets[b].collective == Collective::Int8)
        device_.fill_zero(residual_ + residual_at_[b], program.buckets[b].numel, Dtype::F32,
                          stream_of(static_cast<int>(b)));
  }
  // Bucket `b` (program `p`) reduced on stream `s` over `c`: `buf` holds its n elements where step_in
  // left them (packed or the arena's), `grads` the grads themselves (the copy layout's packed table,
  // or the arena's bucket as one segment) for the collectives that read and write them directly.
  void allreduce(int b, const BucketProgram& p, SegmentTable& grads, void* buf, size_t n, Stream& s, Comm& c);
  // Whether bucket `p`'s int8 collective reads the grads and writes the results itself, pre- and
  // post-scaling on the way (host memory: the rounds and the reduce-scatter), so that the reducer's
  // in and out steps leave the bucket alone.
  static bool reads_grads(const BucketProgram& p, Memory memory) {
    return p.collective == Collective::Int8 && (p.int8_piece || p.int8_scatter) && memory == Memory::Host;
  }
  // The staging bucket `p` needs (bytes): the program's, except where the collective reads the grads
  // itself: none for the rounds, this rank's shard of sums for the reduce-scatter.
  size_t stage_bytes(const BucketProgram& p) const;
  // What it holds: kept errors and exchange buffers.
  uint64_t bytes() const { return bytes_; }

 private:
  void gather(const BucketProgram& p, size_t b, void* buf, size_t n, Stream& s, Comm& c);
  void gather_rounds(const BucketProgram& p, size_t b, SegmentTable& grads, size_t n, Stream& s, Comm& c);
  void scatter(const BucketProgram& p, size_t b, SegmentTable& grads, void* buf, size_t n, Stream& s, Comm& c);
  void release();

  Device& device_;
  const ProgramSettings& settings_;
  int64_t timeout_ms_;
  float* residual_ = nullptr;              // every int8 bucket's kept errors, bucket after bucket
  std::vector<size_t> residual_at_;        // per bucket: its first kept error
  std::vector<size_t> shard_residual_at_;  // per bucket (reduce-scatter): those of re-quantizing this rank's shard
  std::vector<void*> exchange_;            // per stream
  uint64_t bytes_ = 0;
};

}  // namespace ddp
