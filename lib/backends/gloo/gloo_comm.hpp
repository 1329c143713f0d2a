// The Gloo communicator: host memory over TCP, needing no MPI and no launcher but an environment
// (torchrun's) or a shared directory. Ranks meet through the rendezvous store (host/store.hpp);
// each communicator and each of its duplicates is a Gloo context of its own, a full mesh of TCP
// pairs (gloo_mesh). Allreduce, reduce-scatter and all-gather are libddp's host ring over Gloo's
// point-to-point buffers (gloo_ring_link: the same sums, in the same order, as over MPI); the control
// path and ddp_broadcast use Gloo's own algorithms. Every wait is bounded by the call's deadline; a
// peer whose connection closes (its process died) fails the waits on it at once, naming the rank. A
// Gloo context that failed cannot be used again: the context is aborted, as after an MPI timeout.
#pragma once

#include <gloo/context.h>

#include <atomic>
#include <memory>
#include <string>

#include "backends/gloo/gloo_join.hpp"
#include "backends/gloo/gloo_mesh.hpp"
#include "backends/gloo/gloo_ring_link.hpp"
#include "backends/gloo/gloo_world.hpp"
#include "core/comms.hpp"
#include "host/host_device.hpp"
#include "host/ring.hpp"

namespace ddp {

class GlooComm final : public Comm {
 public:
  // Rank `rank` of `size`: the world's own numbers, or those of an elastic recovery's survivors.
  // `lineage`: the key of the communicator this one descends from (its own when empty), under which
  // replacements ask to join.
  // `abandoned`: the store key by which a member of an elastic membership gives up on its creation
  // (StoreAdapter), the same for its duplicates; none for the first world's.
  GlooComm(std::shared_ptr<GlooWorld> w, std::string key, Deadline dl, int rank, int size, std::string lineage = "",
           std::string abandoned = "")
      : world_(std::move(w)),
        key_(std::move(key)),
        lineage_(lineage.empty() ? key_ : std::move(lineage)),
        abandoned_(std::move(abandoned)),
        ctx_(connect_context(world_, key_, dl, rank, size, abandoned_)),
        ring_(std::make_shared<host::RingBuffer>()),
        link_(std::make_shared<GlooRingLink>(*ctx_)) {
    link_->wire = wire_bytes();  // the ring counts its exchanges here
  }
  ~GlooComm() override {
    if (aborted_) {  // a written-off worker may still be inside the context: it stays until exit
      host::keep_until_exit(ctx_);
      host::keep_until_exit(world_);
      host::keep_until_exit(link_);
      host::keep_until_exit(ring_);
      host::keep_until_exit(failed_);
    }
  }

  int rank() const override { return ctx_->rank; }
  int size() const override { return ctx_->size; }
  Memory memory() const override { return Memory::Host; }
  std::unique_ptr<Comm> dup() override;
  std::unique_ptr<Device> make_device() override { return std::unique_ptr<Device>(new HostDevice()); }
  std::unique_ptr<Prober> make_prober(std::function<Position()> mine) override;
  bool supports_wire(Dtype d) const override { return !is_16bit(d); }
  bool supports(RedOp op) const override { return op == RedOp::Sum || op == RedOp::SumScaled; }
  size_t buffer_bytes() const override { return ring_->bytes.load(); }
  size_t piece_elems(Dtype d, size_t bytes) const override {
    return std::max<size_t>(1, std::min(host::kRingMaxBytes, bytes ? bytes : piece_bytes_) / dtype_size(d));
  }

  void allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream&, Deadline dl) override;
  // The 16-bit wires on f32 buckets: the ring from the ring's sizes on, else every rank's cast
  // elements gathered and summed in rank order.
  bool can_cast_ring() const override { return true; }
  void allreduce_as(const void* send, void* recv, size_t n, Dtype d, Dtype wire, Reduction red, Stream&,
                    Deadline dl) override;
  void reduce_scatter(void* buf, size_t m, Dtype d, Reduction red, Stream&, Deadline dl) override;
  void allgather(void* buf, size_t bytes, Stream&, Deadline dl) override {
    if (size() == 1) return;
    run_ring(dl, [&](GlooRingLink& link) { host::ring_allgather(link, static_cast<char*>(buf), bytes); });
  }

  void allgather_rounds(AllgatherRounds& rounds, Stream& s, Deadline dl) override {
    if (size() == 1) return Comm::allgather_rounds(rounds, s, dl);
    run_ring(dl, [&](GlooRingLink& link) { host::ring_allgather_rounds(link, rounds); });
  }

  bool has_alltoall() const override { return true; }
  void alltoall(const void* send, void* recv, size_t bytes, Stream&, Deadline dl) override {
    run_ring(dl, [&](GlooRingLink& link) {
      host::pairwise_alltoall(link, static_cast<const char*>(send), static_cast<char*>(recv), bytes);
    });
  }

  void broadcast(void* buf, size_t bytes, int root, void*, Deadline dl) override {
    broadcast_host(buf, bytes, root, dl);
  }
  void broadcast_host(void* buf, size_t bytes, int root, Deadline dl) override;
  void allgather_host(const void* in, void* out, size_t bytes, Deadline dl) override;
  void abort() override { aborted_ = true; }
  bool can_regroup() const override { return true; }
  void give_up() override;
  void sever() override {
    aborted_ = true;
    severer()();
  }
  void drop_posted() override {
    if (failed_->load()) severer()();
  }
  std::function<void()> severer() override {
    std::shared_ptr<gloo::Context> ctx = ctx_;
    std::shared_ptr<GlooRingLink> link = link_;
    std::shared_ptr<std::atomic<bool>> failed = failed_;
    return [ctx, link, failed] {
      failed->store(true);
      try {
        ctx->closeConnections();  // the peers' waits on this rank fail now
      } catch (...) {             // a pair that never connected: nothing to close
      }
      link->abort_waits();  // and so do this rank's own
    };
  }
  Regrouped regroup(const std::string& epoch, int64_t committed,
                    const std::function<std::vector<Liveness>()>& answering, Deadline window, Deadline dl) override;
  std::shared_ptr<JoinDesk> join_desk() override { return std::make_shared<GlooJoinDesk>(world_, lineage_, key_); }
  std::unique_ptr<Comm> admit(const std::string& name, const std::vector<int64_t>& slots, const std::string& note,
                              Deadline dl) override;

 private:
  static double sum_factor(Reduction red) {
    if (red.op != RedOp::Sum && red.op != RedOp::SumScaled) fail(DDP_ERR_INTERNAL, "Gloo comm: only sums are fused");
    return red.op == RedOp::SumScaled ? red.factor : 1.0;
  }
  // The creation of duplicates and probers: bounded as the communicator's creation was, and by
  // ddp_create's timeout_ms (creation_deadline) when that comes first.
  Deadline init_deadline() const {
    return Deadline::earlier(Deadline::after_ms(world_->init_timeout_ms), creation_deadline());
  }
  void usable() const {
    if (failed_->load())
      fail(DDP_ERR_ABORTED, "rank %d: this Gloo communicator failed earlier and cannot be used", rank());
  }
  template <class F>
  void guarded(F&& f) {
    std::shared_ptr<std::atomic<bool>> failed = failed_;
    try {
      f();
    } catch (const Error& e) {
      failed->store(true);
      if (!link_->severed()) throw;
      fail(DDP_ERR_ABORTED, "%s (after this rank closed its connections: a peer was lost)", e.what());
    } catch (...) {
      failed->store(true);
      throw;
    }
  }
  // A ring collective on a bucket stream's worker. The worker may be written off by its stream at the
  // timeout and the context destroyed while it is still blocked in Gloo; when the call returns it must
  // touch nothing of `this`: it holds the link, the ring buffer (captured by the caller) and the
  // failure flag itself, which an aborted comm keeps until exit, and parks (BlockingCall).
  template <class F>
  void run_ring(Deadline dl, F&& f) {
    usable();
    host::BlockingCall call;        // a written-off worker parks when the call returns
    host::SigpipeBlock no_sigpipe;  // once for the ring's many Gloo calls
    std::shared_ptr<GlooRingLink> link = link_;
    std::shared_ptr<std::atomic<bool>> failed = failed_;
    link->start(dl);
    try {
      f(*link);
    } catch (...) {
      failed->store(true);
      throw;
    }
  }
  // Every rank's piece gathered around the ring, then summed in rank order: the same bits everywhere.
  static void small_allreduce(GlooRingLink& link, host::RingBuffer& ring, const char* from, char* to, size_t k, Dtype d,
                              double factor);
  void barrier(Deadline dl);

  std::shared_ptr<GlooWorld> world_;
  std::string key_;
  std::string lineage_;
  std::string abandoned_;
  std::shared_ptr<gloo::Context> ctx_;
  std::shared_ptr<host::RingBuffer> ring_;
  std::shared_ptr<GlooRingLink> link_;
  size_t piece_bytes_ = host::piece_bytes();
  int dups_ = 0;
  bool aborted_ = false;
  std::string latest_attempt(const std::string& epoch, Deadline dl);
  std::string tried_epoch_;       // the membership ("E.") of the last agreement run over this communicator
  long long tried_attempt_ = -1;  // and its attempt
  std::shared_ptr<std::atomic<bool>> failed_ = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace ddp
