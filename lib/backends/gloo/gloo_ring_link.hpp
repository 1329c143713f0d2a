// The host ring's link (host/ring.hpp) over Gloo's point-to-point buffers.
#pragma once

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "backends/gloo/gloo_world.hpp"
#include "host/ring.hpp"

namespace ddp {

// Messages of the ring; Gloo's own algorithms use slots with a prefix byte of 1..8.
constexpr uint64_t kRingSlot = uint64_t(0x7d) << 56;

// The ring's neighbours over Gloo's unbound buffers, one per distinct (pointer, size) and kept: a
// bucket's pieces are the same in every iteration, so steady state allocates nothing.
class GlooRingLink final : public host::RingLink {
 public:
  explicit GlooRingLink(gloo::Context& ctx) : ctx_(ctx) {}
  int rank() const override { return ctx_.rank; }
  int size() const override { return ctx_.size; }
  void start(Deadline dl) { dl_ = dl; }
  void exchange_with(int right, const void* out, size_t sn, int left_rank, void* in, size_t rn) override {
    post_with(right, out, sn, left_rank, in, rn);
    wait_posted();
  }
  // Gloo's unbound buffers move the bytes on its own event loop: the exchange goes on while the
  // caller works.
  void post_with(int right, const void* out, size_t sn, int left_rank, void* in, size_t rn) override {
    o_ = i_ = nullptr;
    if (aborted_.load()) fail(DDP_ERR_ABORTED, "rank %d: the Gloo ring was aborted (a peer was lost)", rank());
    to_ = right, from_ = left_rank;
    // Posting throws too once a peer's connection has closed.
    link_call(format("ring exchange (posting to rank %d and from rank %d)", right, left_rank), [&] {
      o_ = sn ? buffer(const_cast<void*>(out), sn) : nullptr;
      i_ = rn ? buffer(in, rn) : nullptr;
      if (i_) i_->recv(left_rank, kRingSlot);
      if (o_) o_->send(right, kRingSlot);
    });
  }
  // Whether abort_waits was called: this rank closed its connections after a lost peer.
  bool severed() const { return aborted_.load(); }
  void wait_posted() override {
    gloo::transport::UnboundBuffer *o = o_, *i = i_;
    o_ = i_ = nullptr;
    if (i) wait(from_, "receive from", i, true);
    if (o) wait(to_, "send to", o, false);
  }
  // Wakes this link's wait from another thread (an elastic context that lost a peer): the wait in
  // progress returns as aborted, and so does every later one. Gloo fails a wait on a connection that
  // closes, but not one posted on a connection this rank closed itself, nor one on a live peer that is
  // itself stuck.
  void abort_waits() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    if (waiting_recv_) waiting_recv_->abortWaitRecv();
    if (waiting_send_) waiting_send_->abortWaitSend();
  }

 private:
  void wait(int peer, const char* dir, gloo::transport::UnboundBuffer* b, bool recv) {
    gloo::transport::UnboundBuffer*& slot = recv ? waiting_recv_ : waiting_send_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_.load()) fail(DDP_ERR_ABORTED, "rank %d: the Gloo ring was aborted (a peer was lost)", rank());
      slot = b;
    }
    bool ok = false;
    try {
      link_call(format("ring exchange (%s rank %d)", dir, peer),
                [&] { ok = recv ? b->waitRecv(gloo_left(dl_)) : b->waitSend(gloo_left(dl_)); });
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      slot = nullptr;
      throw;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      slot = nullptr;
    }
    if (!ok) fail(DDP_ERR_ABORTED, "rank %d: the Gloo ring exchange was aborted", rank());
  }
  // A Gloo call of the ring. Once this rank has severed its connections, whatever Gloo says of a
  // closed pair (a check that fails, an I/O error) is the abort it is.
  template <class F>
  void link_call(const std::string& what, F&& f) {
    try {
      gloo_call(ctx_.rank, ctx_.size, what, std::forward<F>(f));
    } catch (const Error& e) {
      if (!aborted_.load()) throw;
      fail(DDP_ERR_ABORTED, "rank %d: %s (after this rank closed its connections: a peer was lost)", rank(), e.what());
    }
  }
  gloo::transport::UnboundBuffer* buffer(void* p, size_t n) {
    auto& b = cache_[{p, n}];
    if (!b) {
      if (cache_.size() > 1024) {  // pointers that move every iteration (copy layout): start over
        cache_.clear();
        return buffer(p, n);
      }
      b = ctx_.createUnboundBuffer(p, n);
    }
    return b.get();
  }
  gloo::Context& ctx_;
  Deadline dl_;
  gloo::transport::UnboundBuffer *o_ = nullptr, *i_ = nullptr;  // the posted exchange's
  int to_ = 0, from_ = 0;
  std::mutex mu_;  // guards the two below against abort_waits
  gloo::transport::UnboundBuffer *waiting_send_ = nullptr, *waiting_recv_ = nullptr;
  std::atomic<bool> aborted_{false};
  std::map<std::pair<void*, size_t>, std::unique_ptr<gloo::transport::UnboundBuffer>> cache_;
};

}  // namespace ddp
