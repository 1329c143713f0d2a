// The Gloo communicator's collectives and its makers (gloo_comm.hpp).
#include "backends/gloo/gloo_comm.hpp"

#include <gloo/allgather.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>

#include <algorithm>
#include <cstring>

#include "backends/gloo/gloo_mesh.hpp"
#include "host/host_kernels.hpp"
#include "host/limits.hpp"
#include "host/marked_store.hpp"
#include "host/probe.hpp"

namespace ddp {

namespace {

// Below this many bytes an allreduce is an all-gather and a sum in rank order (latency-bound sizes).
constexpr size_t kRingMinBytes = size_t(64) << 10;

}  // namespace

std::unique_ptr<Prober> GlooComm::make_prober(std::function<Position()> mine) {
  const Deadline dl = init_deadline();
  MarkedStore store(*world_->rv.store, abandoned_);  // (an elastic membership's members give up together)
  return make_socket_prober(abandoned_.empty() ? *world_->rv.store : store, key_ + ".probe" + std::to_string(++dups_),
                            rank(), size(), world_->rv.host, std::move(mine), dl, [&] { barrier(dl); });
}

// Another mesh over the same ranks, under a key of its own; checked against the open-file limit as
// the first was (a context duplicates its communicator for each stream).
std::unique_ptr<Comm> GlooComm::dup() {
  host::ensure_socket_room(size() - 1, host::ranks_on_this_host(), 4L * (size() - 1) + 8,
                           format("Gloo: a duplicate communicator over a world of %d ranks", size()));
  return std::unique_ptr<Comm>(new GlooComm(world_, key_ + "." + std::to_string(++dups_), init_deadline(), rank(),
                                            size(), lineage_, abandoned_));
}

void GlooComm::give_up() {
  MarkedStore::mark(*world_->rv.store, abandoned_, "rank " + std::to_string(rank()) + " of the new membership");
  sever();
}

void GlooComm::allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream&, Deadline dl) {
  const double factor = sum_factor(red);
  const size_t es = dtype_size(d);
  if (size() == 1) return host::convert(send, d, recv, d, n, factor);
  host::RingBuffer& ring = *ring_;  // (the lambdas below read nothing of `this`: see run_ring)
  run_ring(dl, [&](GlooRingLink& link) {
    for (size_t done = 0; done < n;) {
      const size_t k = std::min(host::kRingMaxBytes / es, n - done);
      const char* from = static_cast<const char*>(send) + done * es;
      char* to = static_cast<char*>(recv) + done * es;
      if (k * es >= kRingMinBytes && k >= static_cast<size_t>(link.size()))
        host::ring_allreduce(link, ring, from, to, k, d, factor);
      else
        small_allreduce(link, ring, from, to, k, d, factor);
      done += k;
    }
  });
}

void GlooComm::allreduce_as(const void* send, void* recv, size_t n, Dtype d, Dtype wire, Reduction red, Stream&,
                            Deadline dl) {
  if (d != Dtype::F32 || !is_16bit(wire)) fail(DDP_ERR_INTERNAL, "Gloo comm: a cast ring takes f32 to a 16-bit wire");
  const double factor = sum_factor(red);
  const float* from = static_cast<const float*>(send);
  float* to = static_cast<float*>(recv);
  if (size() == 1) return host::round_through(from, to, n, wire, factor);
  host::RingBuffer& ring = *ring_;
  run_ring(dl, [&](GlooRingLink& link) {
    const size_t ws = dtype_size(wire);
    for (size_t done = 0; done < n;) {
      const size_t k = std::min(host::kRingMaxBytes / ws, n - done);
      if (k * ws >= kRingMinBytes && k >= static_cast<size_t>(link.size()))
        host::ring_allreduce_cast(link, ring, from + done, to + done, k, wire, factor);
      else
        host::gathered_allreduce_cast(link, ring, from + done, to + done, k, wire, factor);
      done += k;
    }
  });
}

void GlooComm::reduce_scatter(void* buf, size_t m, Dtype d, Reduction red, Stream&, Deadline dl) {
  const double factor = sum_factor(red);
  char* p = static_cast<char*>(buf);
  if (size() == 1) return host::convert(p, d, p, d, m, factor);
  host::RingBuffer& ring = *ring_;
  const size_t piece = piece_bytes_;
  run_ring(dl, [&](GlooRingLink& link) { host::ring_reduce_scatter(link, ring, p, m, d, factor, piece); });
}

void GlooComm::broadcast_host(void* buf, size_t bytes, int root, Deadline dl) {
  if (root < 0 || root >= size())
    fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size() - 1);
  if (size() == 1 || bytes == 0) return;
  usable();
  guarded([&] {
    gloo_call(rank(), size(), format("broadcast from rank %d", root), [&] {
      gloo::BroadcastOptions o(ctx_);
      o.setOutput(static_cast<uint8_t*>(buf), bytes);
      o.setRoot(root);
      o.setTimeout(gloo_left(dl));
      gloo::broadcast(o);
    });
  });
  wire_bytes()->broadcast(bytes, size(), rank(), root);
}

void GlooComm::allgather_host(const void* in, void* out, size_t bytes, Deadline dl) {
  if (size() == 1 || bytes == 0) {
    if (bytes) std::memcpy(out, in, bytes);
    return;
  }
  usable();
  guarded([&] {
    gloo_call(rank(), size(), "all-gather", [&] {
      gloo::AllgatherOptions o(ctx_);
      o.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(in)), bytes);
      o.setOutput(static_cast<uint8_t*>(out), bytes * static_cast<size_t>(size()));
      o.setTimeout(gloo_left(dl));
      gloo::allgather(o);
    });
  });
  wire_bytes()->allgather(bytes, size());
}

void GlooComm::small_allreduce(GlooRingLink& link, host::RingBuffer& ring, const char* from, char* to, size_t k,
                               Dtype d, double factor) {
  const int world = link.size();
  const size_t bytes = k * dtype_size(d);
  char* all = ring.ensure(bytes * static_cast<size_t>(world));
  std::memcpy(all + static_cast<size_t>(link.rank()) * bytes, from, bytes);
  host::ring_allgather(link, all, bytes);
  host::convert(all, d, to, d, k, 1.0);
  for (int r = 1; r < world; ++r)
    host::sum_scaled(to, all + static_cast<size_t>(r) * bytes, to, k, d, r == world - 1 ? factor : 1.0);
}

void GlooComm::barrier(Deadline dl) {
  gloo_call(rank(), size(), "barrier", [&] {
    gloo::BarrierOptions b(ctx_);
    b.setTimeout(gloo_left(dl));
    gloo::barrier(b);
  });
}

namespace {

// Before connections are made: the open files and ports that a context over a world of `size`
// needs (this communicator's mesh, and the control, broadcast and stream communicators duplicated
// from it, each a mesh of its own), or a refusal that gives the numbers and the fix.
void ensure_room_for(int size) {
  if (size <= 1) return;
  const long per_rank = 4L * (size - 1) + 8;
  host::ensure_socket_room(per_rank, host::ranks_on_this_host(), per_rank, format("Gloo: a world of %d ranks", size));
}

}  // namespace

std::unique_ptr<Comm> make_gloo_comm(const char* init_method, int rank, int size, int64_t timeout_ms) {
  const Deadline dl = Deadline::after_ms(timeout_ms);
  if (size > 0) ensure_room_for(size);
  std::shared_ptr<GlooWorld> w = open_world(init_method, rank, size, timeout_ms, dl);
  if (size <= 0) ensure_room_for(w->rv.size);  // (the size the environment gave)
  const int n = w->comms++;
  return std::unique_ptr<Comm>(new GlooComm(w, "c" + std::to_string(n), dl, w->rv.rank, w->rv.size));
}

// Every joiner asks the contexts made over the job's first communicator ("c0": what a rank's first
// ddp_comm_init_gloo makes), however many joiners one process holds.
std::unique_ptr<Comm> make_gloo_join_comm(const char* init_method, int64_t timeout_ms) {
  const Deadline dl = Deadline::after_ms(timeout_ms);
  std::shared_ptr<GlooWorld> w = open_world(init_method, -1, 0, timeout_ms, dl, true);
  return std::unique_ptr<Comm>(make_gloo_joining_comm(w, "c0"));
}

bool have_gloo() { return true; }

}  // namespace ddp
