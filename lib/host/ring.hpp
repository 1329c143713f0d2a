// The host ring: libddp's own allreduce, reduce-scatter and all-gather over any host communicator
// that can exchange bytes with its two neighbours (MPI, Gloo), and the all-to-all of the int8 wire,
// which exchanges with every rank in turn. The pass that adds the last rank's
// contribution to a chunk also applies the averaging factor, so averaging costs no pass of its own,
// and every rank receives the same bits (each chunk is finished by one rank and copied to the others).
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <vector>

#include "core/backend.hpp"
#include "core/common.hpp"

namespace ddp {
namespace host {

// A rank's place in a ring of `size` ranks.
class RingLink {
 public:
  virtual ~RingLink() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Sends `out_bytes` from `out` to rank `to` while receiving `in_bytes` into `in` from rank `from`,
  // and returns when both are done. Throws (a timeout, a broken peer) naming the peer.
  virtual void exchange_with(int to, const void* out, size_t out_bytes, int from, void* in, size_t in_bytes) = 0;
  // The same exchange in two halves, so that the caller can work while it is on the wire: post_with
  // starts it (both buffers stay in use) and wait_posted returns when both directions are done. At
  // most one exchange is posted at a time. By default post_with runs the whole exchange.
  virtual void post_with(int to, const void* out, size_t out_bytes, int from, void* in, size_t in_bytes) {
    exchange_with(to, out, out_bytes, from, in, in_bytes);
  }
  virtual void wait_posted() {}
  // The ring's step: to rank + 1, from rank - 1.
  void exchange(const void* out, size_t out_bytes, void* in, size_t in_bytes) {
    exchange_with((rank() + 1) % size(), out, out_bytes, (rank() + size() - 1) % size(), in, in_bytes);
  }
  // Where the ring functions count each exchange's bytes (the communicator's counters), or none.
  std::shared_ptr<WireBytes> wire;
};

// The ring's receive buffer (one chunk from the left neighbour), kept by the communicator; `bytes`
// is read by ddp_get_stats from any thread.
struct RingBuffer {
  std::vector<char> scratch;
  std::atomic<size_t> bytes{0};
  char* ensure(size_t n);
};

// At most this many bytes per allreduce call or all-gather step.
constexpr size_t kRingMaxBytes = size_t(64) << 20;

// recv = factor * (the sum over ranks of send), n elements (n >= size, n * dtype <= kRingMaxBytes).
// `send == recv` reduces in place.
void ring_allreduce(RingLink& link, RingBuffer& rb, const void* send, void* recv, size_t n, Dtype d, double factor);
// The same for an f32 buffer whose bytes travel as the 16-bit `wire`: each reduce-scatter step sends
// its partial sums cast to the wire and adds what it receives, widened, into f32; the rank that
// finishes a chunk scales it and rounds it to the wire once, and the all-gather carries those 16
// bits, so every rank ends with the same values (n >= size).
void ring_allreduce_cast(RingLink& link, RingBuffer& rb, const float* send, float* recv, size_t n, Dtype wire,
                         double factor);
// Below the ring's sizes: every rank's elements cast to the wire, all-gathered around the ring, and
// summed (widened, in f32) in rank order; the sum is scaled and rounded to the wire once.
void gathered_allreduce_cast(RingLink& link, RingBuffer& rb, const float* send, float* recv, size_t n, Dtype wire,
                             double factor);
// In place over size() chunks of m elements (chunk c at buf + c * m): afterwards chunk rank() holds
// factor * the sum of every rank's chunk rank(). In pieces of about `piece_bytes` per exchange.
void ring_reduce_scatter(RingLink& link, RingBuffer& rb, char* buf, size_t m, Dtype d, double factor,
                         size_t piece_bytes);
// In place over size() chunks of `bytes`: each rank's own chunk travels once around the ring.
void ring_allgather(RingLink& link, char* buf, size_t bytes);
// All-gathers in rounds with the work around each overlapped (core/backend.hpp, AllgatherRounds):
// round k + 1's first exchange is posted before round k's done() and round k + 2's fill() run.
void ring_allgather_rounds(RingLink& link, AllgatherRounds& rounds);
// All-to-all of size() blocks of `bytes`: block j of `send` reaches rank j, and block i of `recv` is
// rank i's block rank() (`send` and `recv` do not overlap). In size() - 1 steps, the k-th exchanging
// with rank + k and rank - k, so every byte crosses the wire once: (size() - 1) blocks each way.
void pairwise_alltoall(RingLink& link, const char* send, char* recv, size_t bytes);

}  // namespace host
}  // namespace ddp
