#include "host/ring.hpp"

#include <algorithm>
#include <cstring>

#include "host/host_kernels.hpp"

namespace ddp {
namespace host {

namespace {
// One exchange with the neighbours (or, all-to-all, with two other ranks), counted where the bytes move.
void exchange(RingLink& link, const void* out, size_t out_bytes, void* in, size_t in_bytes) {
  link.exchange(out, out_bytes, in, in_bytes);
  if (link.wire) link.wire->add(out_bytes, in_bytes);
}
void exchange_with(RingLink& link, int to, const void* out, size_t out_bytes, int from, void* in, size_t in_bytes) {
  link.exchange_with(to, out, out_bytes, from, in, in_bytes);
  if (link.wire) link.wire->add(out_bytes, in_bytes);
}
}  // namespace

char* RingBuffer::ensure(size_t n) {
  if (scratch.size() < n) {
    scratch.resize(n);
    bytes.store(scratch.size());
  }
  return scratch.data();
}

// Chunk c is [lo(c), lo(c+1)). Reduce-scatter: at step s a rank passes chunk (rank - s) to the right
// and adds the one it receives, chunk (rank - s - 1), into recv; at the last step that chunk
// (rank + 1) holds every contribution and the same pass scales it. Allgather: the finished chunks
// travel once around the ring.
void ring_allreduce(RingLink& link, RingBuffer& rb, const void* send, void* recv, size_t n, Dtype d, double factor) {
  const size_t es = dtype_size(d);
  const int w = link.size(), me = link.rank();
  auto lo = [&](int c) { return n * static_cast<size_t>(c) / static_cast<size_t>(w); };
  auto at = [&](const void* base, int c) { return static_cast<const char*>(base) + lo(c) * es; };
  auto len = [&](int c) { return lo(c + 1) - lo(c); };
  auto chunk = [&](int k) { return ((k % w) + w) % w; };
  char* scratch = rb.ensure((n + static_cast<size_t>(w) - 1) / static_cast<size_t>(w) * es);
  for (int s = 0; s < w - 1; ++s) {
    const int out = chunk(me - s), in = chunk(me - s - 1);
    exchange(link, s == 0 ? at(send, out) : at(recv, out), len(out) * es, scratch, len(in) * es);
    char* mine = const_cast<char*>(at(recv, in));
    host::sum_scaled(at(send, in), scratch, mine, len(in), d, s == w - 2 ? factor : 1.0);
  }
  for (int s = 0; s < w - 1; ++s) {
    const int out = chunk(me + 1 - s), in = chunk(me - s);
    exchange(link, at(recv, out), len(out) * es, const_cast<char*>(at(recv, in)), len(in) * es);
  }
}

// As ring_allreduce, with two wire-typed buffers of a chunk each: `out` holds what goes to the right
// (the cast partial sum; in the all-gather, the chunk to pass on), `in` what came from the left.
void ring_allreduce_cast(RingLink& link, RingBuffer& rb, const float* send, float* recv, size_t n, Dtype wire,
                         double factor) {
  const size_t ws = dtype_size(wire);
  const int w = link.size(), me = link.rank();
  auto lo = [&](int c) { return n * static_cast<size_t>(c) / static_cast<size_t>(w); };
  auto len = [&](int c) { return lo(c + 1) - lo(c); };
  auto chunk = [&](int k) { return ((k % w) + w) % w; };
  const size_t most = (n + static_cast<size_t>(w) - 1) / static_cast<size_t>(w);
  char* out = rb.ensure(2 * most * ws);
  char* in = out + most * ws;
  for (int s = 0; s < w - 1; ++s) {
    const int o = chunk(me - s), i = chunk(me - s - 1);
    convert((s == 0 ? send : recv) + lo(o), Dtype::F32, out, wire, len(o), 1.0);
    exchange(link, out, len(o) * ws, in, len(i) * ws);
    const bool last = s == w - 2;  // chunk i is finished: scale it, round it, keep its bits to send
    host::add_widened(send + lo(i), in, wire, recv + lo(i), len(i), last ? factor : 1.0, last ? out : nullptr);
  }
  for (int s = 0; s < w - 1; ++s) {
    const int o = chunk(me + 1 - s), i = chunk(me - s);
    exchange(link, out, len(o) * ws, in, len(i) * ws);
    convert(in, wire, recv + lo(i), Dtype::F32, len(i), 1.0);
    std::swap(out, in);
  }
}

void gathered_allreduce_cast(RingLink& link, RingBuffer& rb, const float* send, float* recv, size_t n, Dtype wire,
                             double factor) {
  const size_t bytes = n * dtype_size(wire);
  const int w = link.size();
  char* all = rb.ensure(bytes * static_cast<size_t>(w));
  char* mine = all + static_cast<size_t>(link.rank()) * bytes;
  convert(send, Dtype::F32, mine, wire, n, 1.0);
  ring_allgather(link, all, bytes);
  convert(all, wire, recv, Dtype::F32, n, 1.0);
  for (int r = 1; r < w; ++r)  // this rank's own bits are no longer needed: the last add rounds into them
    host::add_widened(recv, all + static_cast<size_t>(r) * bytes, wire, recv, n, r == w - 1 ? factor : 1.0,
                      r == w - 1 ? mine : nullptr);
}

// In pieces of each chunk: at step s a rank passes its partial sum of chunk (rank - s - 1) to the
// right and adds the one it receives, chunk (rank - s - 2), into buf; at the last step that is its
// own chunk, which then holds every contribution, and the same pass scales it.
void ring_reduce_scatter(RingLink& link, RingBuffer& rb, char* buf, size_t m, Dtype d, double factor,
                         size_t piece_bytes) {
  const size_t es = dtype_size(d);
  const int w = link.size(), me = link.rank();
  auto chunk = [&](int k) { return static_cast<size_t>(((k % w) + w) % w); };
  // Pieces of the host piece size in all (as the allreduce's): the sum reads what just arrived while
  // it is still in cache.
  const size_t piece = std::max<size_t>(1, std::min(m, piece_bytes / es / static_cast<size_t>(w)));
  char* scratch = rb.ensure(piece * es);
  for (size_t lo = 0; lo < m; lo += piece) {
    const size_t n = std::min(piece, m - lo);
    auto at = [&](size_t c) { return buf + (c * m + lo) * es; };
    for (int s = 0; s < w - 1; ++s) {
      char* in = at(chunk(me - s - 2));
      exchange(link, at(chunk(me - s - 1)), n * es, scratch, n * es);
      host::sum_scaled(in, scratch, in, n, d, s == w - 2 ? factor : 1.0);
    }
  }
}

void ring_allgather(RingLink& link, char* buf, size_t bytes) {
  const int w = link.size(), me = link.rank();
  auto chunk = [&](int k) { return static_cast<size_t>(((k % w) + w) % w); };
  for (size_t lo = 0; lo < bytes; lo += kRingMaxBytes) {
    const size_t n = std::min(kRingMaxBytes, bytes - lo);
    for (int s = 0; s < w - 1; ++s)
      exchange(link, buf + chunk(me - s) * bytes + lo, n, buf + chunk(me - s - 1) * bytes + lo, n);
  }
}

// Round k's chunks: chunk c at buffer(k) + c * bytes(k). Its first ring step is posted, then the
// work that does not touch its buffer runs (the previous round's done, the next round's fill: each
// round has a buffer of its own, the caller alternating two), then the remaining steps follow.
void ring_allgather_rounds(RingLink& link, AllgatherRounds& rounds) {
  const int w = link.size(), me = link.rank();
  const size_t n = rounds.count();
  auto chunk = [&](int k) { return static_cast<size_t>(((k % w) + w) % w); };
  auto post_first = [&](size_t k) {
    char* buf = rounds.buffer(k);
    const size_t bytes = rounds.bytes(k);
    link.post_with((me + 1) % w, buf + chunk(me) * bytes, bytes, (me + w - 1) % w, buf + chunk(me - 1) * bytes, bytes);
    if (link.wire) link.wire->add(bytes, bytes);
  };
  auto finish = [&](size_t k) {  // the posted first step's end, then the others
    link.wait_posted();
    char* buf = rounds.buffer(k);
    const size_t bytes = rounds.bytes(k);
    for (int s = 1; s < w - 1; ++s)
      exchange(link, buf + chunk(me - s) * bytes, bytes, buf + chunk(me - s - 1) * bytes, bytes);
  };
  if (n == 0) return;
  rounds.fill(0);
  if (w < 2) {
    for (size_t k = 0; k < n; ++k) {
      if (k + 1 < n) rounds.fill(k + 1);
      rounds.done(k);
    }
    return;
  }
  post_first(0);
  bool posted = true;
  try {
    if (n > 1) rounds.fill(1);
    finish(0);
    posted = false;
    for (size_t k = 1; k < n; ++k) {
      post_first(k);
      posted = true;
      rounds.done(k - 1);
      if (k + 1 < n) rounds.fill(k + 1);
      finish(k);
      posted = false;
    }
  } catch (...) {
    // The caller's buffers must not be released under a posted exchange.
    if (posted) {
      try {
        link.wait_posted();
      } catch (...) {
      }
    }
    throw;
  }
  rounds.done(n - 1);
}

void pairwise_alltoall(RingLink& link, const char* send, char* recv, size_t bytes) {
  const int w = link.size(), me = link.rank();
  const size_t at = static_cast<size_t>(me) * bytes;
  if (bytes) std::memcpy(recv + at, send + at, bytes);
  for (int k = 1; k < w; ++k) {
    const int to = (me + k) % w, from = (me + w - k) % w;
    for (size_t lo = 0; lo < bytes; lo += kRingMaxBytes) {
      const size_t n = std::min(kRingMaxBytes, bytes - lo);
      exchange_with(link, to, send + static_cast<size_t>(to) * bytes + lo, n, from,
                    recv + static_cast<size_t>(from) * bytes + lo, n);
    }
  }
}

}  // namespace host
}  // namespace ddp
