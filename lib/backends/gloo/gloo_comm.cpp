// The Gloo communicator: host memory over TCP, needing no MPI and no launcher but an environment
// (torchrun's) or a shared directory. Ranks meet through the rendezvous store (host/
// store.hpp); each communicator and each of its duplicates is a Gloo context of its own, a full mesh
// of TCP pairs. Allreduce, reduce-scatter and all-gather are libddp's host ring over Gloo's
// point-to-point buffers (the same sums, in the same order, as over MPI); the control path and
// ddp_broadcast use Gloo's own algorithms. Every wait is bounded by the call's deadline; a peer whose
// connection closes (its process died) fails the waits on it at once, naming the rank. A Gloo
// context that failed cannot be used again: the context is aborted, as after an MPI timeout.
#include "backends/gloo/gloo_errors.hpp"
#include "core/comms.hpp"
#include "core/knobs.hpp"

#include <gloo/allgather.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "host/host_device.hpp"
#include "host/host_kernels.hpp"
#include "host/membership.hpp"
#include "host/probe.hpp"
#include "host/ring.hpp"
#include "host/sigpipe.hpp"
#include "host/rendezvous.hpp"
#include "host/tcp.hpp"

namespace ddp {

namespace {

using Ms = std::chrono::milliseconds;
// "Forever" for Gloo, whose waits always take a bound: 30 days.
constexpr int64_t kForeverMs = int64_t(30) * 24 * 3600 * 1000;
// Messages of the ring; Gloo's own algorithms use slots with a prefix byte of 1..8.
constexpr uint64_t kRingSlot = uint64_t(0x7d) << 56;
// Below this many bytes an allreduce is an all-gather and a sum in rank order (latency-bound sizes).
constexpr size_t kRingMinBytes = size_t(64) << 10;

Ms left(Deadline dl) { return Ms(tcp::ms_left(dl, kForeverMs)); }

// The ranks' meeting place and the TCP device their contexts share.
struct GlooWorld {
  std::string method;
  Rendezvous rv;
  std::shared_ptr<gloo::transport::Device> device;
  int64_t init_timeout_ms = 0;       // the creation's bound, also that of duplicates and probers
  std::atomic<int> comms{0};         // communicators made over it so far (the same count on every rank)
  std::atomic<bool> settled{false};  // the arrival's keys erased (rank 0, after the first barrier)
};

// Gloo's store interface over ours: keys under a prefix, waits bounded by the creation's deadline;
// remembers the keys this rank set, to erase them once every rank has read them. A creation over an
// elastic membership also ends as soon as a member gives up on it (`abandoned`, set by
// mark_abandoned): its keys would never come, and the others would wait out the deadline while it
// went on to the next attempt without them.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(ddp::Store& s, std::string prefix, Deadline dl, std::string abandoned)
      : s_(s), prefix_(std::move(prefix)), dl_(dl), abandoned_(std::move(abandoned)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    s_.set(prefix_ + key, data, dl_);
    mine_.push_back(prefix_ + key);
  }
  std::vector<char> get(const std::string& key) override {
    if (!abandoned_.empty()) return watched({prefix_ + key}).front();
    return s_.get(prefix_ + key, dl_, who(key));
  }
  void wait(const std::vector<std::string>& keys) override {
    std::vector<std::string> mine;
    for (const std::string& k : keys) mine.push_back(prefix_ + k);
    if (!abandoned_.empty()) {
      watched(mine);
      return;
    }
    s_.wait(mine, dl_, [](const std::string& k) { return who(k); });  // one request, no values
  }
  void wait(const std::vector<std::string>& keys, const Ms&) override { wait(keys); }
  void erase_mine() {
    for (const std::string& k : mine_) s_.erase(k);
  }

 private:
  // Gloo's keys end in the rank that sets them.
  static std::string who(const std::string& key) {
    const size_t i = key.find_last_not_of("0123456789");
    return i + 1 < key.size() ? "rank " + key.substr(i + 1) : "a rank";
  }
  // The values of `keys` once all are set; fails when a member gives up on the creation first.
  std::vector<std::vector<char>> watched(const std::vector<std::string>& keys) {
    std::vector<std::string> all(keys);
    all.push_back(abandoned_);
    std::vector<ddp::Store::Seen> seen(all.size());
    for (;;) {
      if (seen.back().set)
        fail(DDP_ERR_ABORTED, "%s gave up on this membership (a member was lost while it was being formed)",
             std::string(seen.back().value.begin(), seen.back().value.end()).c_str());
      size_t missing = 0;
      while (missing < keys.size() && seen[missing].set) ++missing;
      if (missing == keys.size()) break;
      if (!s_.watch(all, &seen, dl_)) s_.get(keys[missing], dl_, who(keys[missing]));  // (throws its timeout)
    }
    std::vector<std::vector<char>> values;
    for (size_t i = 0; i < keys.size(); ++i) values.push_back(std::move(seen[i].value));
    return values;
  }
  ddp::Store& s_;
  std::string prefix_;
  Deadline dl_;
  std::string abandoned_;
  std::vector<std::string> mine_;
};

// Tells the other members of an elastic membership that this rank gave up on it (see StoreAdapter):
// best effort, a second at most (the store may be what failed).
void mark_abandoned(ddp::Store& store, const std::string& abandoned, const std::string& who) {
  if (abandoned.empty()) return;
  try {
    store.set(abandoned, std::vector<char>(who.begin(), who.end()), Deadline::after_ms(1000));
  } catch (...) {
  }
}

// Runs a Gloo call, turning its exceptions into ours (rethrow_gloo_failure). A write to a dead peer
// fails instead of raising SIGPIPE (host/sigpipe.hpp); Gloo's event loop, started by the device's
// creation here, keeps SIGPIPE blocked.
template <class F>
void gloo_call(int rank, int size, const std::string& what, F&& f) {
  host::SigpipeBlock no_sigpipe;
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (...) {
    rethrow_gloo_failure(rank, size, what);
  }
}

// Gloo's mesh and a first barrier over it.
void connect_mesh(GlooWorld& w, const std::shared_ptr<gloo::rendezvous::Context>& ctx, StoreAdapter& adapter,
                  Deadline dl) {
  gloo_call(ctx->rank, ctx->size, "connection of the ranks' mesh (" + w.rv.describe + ")", [&] {
    ctx->connectFullMesh(adapter, w.device);
    gloo::BarrierOptions b(ctx);
    b.setTimeout(left(dl));
    gloo::barrier(b);
  });
}

// An elastic membership's mesh, given up as soon as a member gives up on it. Gloo's wait for a peer's
// first connection cannot be interrupted (a member that died after it published its address leaves
// the others waiting to the deadline, while the member that saw the refusal goes on to the next
// attempt without them): the mesh is made on a thread of its own, and this one watches the store for
// the mark. A mesh given up on is left to its thread, which ends at the deadline.
void connect_mesh_abandonable(const std::shared_ptr<GlooWorld>& w, const std::shared_ptr<gloo::rendezvous::Context>& ctx,
                              const std::shared_ptr<StoreAdapter>& adapter, const std::string& abandoned, Deadline dl) {
  struct Outcome {
    std::atomic<bool> done{false};
    std::exception_ptr error;
  };
  auto out = std::make_shared<Outcome>();
  std::thread([w, ctx, adapter, out, dl] {
    try {
      connect_mesh(*w, ctx, *adapter, dl);
    } catch (...) {
      out->error = std::current_exception();
    }
    out->done.store(true);
    w->rv.store->interrupt();  // the watch below looks at `done` at once
  }).detach();
  std::vector<ddp::Store::Seen> seen(1);
  while (!out->done.load()) {
    bool changed = false;
    try {
      changed = w->rv.store->watch({abandoned}, &seen, dl, &out->done);
    } catch (const Error&) {  // the store failed: the mesh's own waits say so
    }
    if (changed && seen[0].set) {
      host::keep_until_exit(ctx);
      fail(DDP_ERR_ABORTED, "%s gave up on this membership (a member was lost while it was being formed)",
           std::string(seen[0].value.begin(), seen[0].value.end()).c_str());
    }
    if (!changed && !out->done.load()) std::this_thread::sleep_for(Ms(10));  // past the deadline: Gloo's own end
  }
  if (out->error) std::rethrow_exception(out->error);
}

// A full mesh among `size` ranks of the world (all of them, or the survivors of an elastic recovery,
// renumbered) under the store prefix `key`.
std::shared_ptr<gloo::Context> connect_context(const std::shared_ptr<GlooWorld>& w, const std::string& key, Deadline dl,
                                               int rank, int size, const std::string& abandoned) {
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  // Gloo waits five times the context's timeout for a pair's first connection (a peer that died in
  // the rendezvous): a fifth of what is left, so that the whole creation ends within `dl`.
  ctx->setTimeout(Ms(std::max<int64_t>(1, tcp::ms_left(dl, kForeverMs) / 5)));
  auto adapter = std::make_shared<StoreAdapter>(*w->rv.store, key + "/", dl, abandoned);
  try {
    if (abandoned.empty())
      connect_mesh(*w, ctx, *adapter, dl);
    else
      connect_mesh_abandonable(w, ctx, adapter, abandoned, dl);
  } catch (const Error&) {
    mark_abandoned(*w->rv.store, abandoned, "rank " + std::to_string(rank) + " of the new membership");
    throw;
  }
  adapter->erase_mine();  // after the barrier every rank has read them
  if (!w->settled.exchange(true)) settle_rendezvous(w->rv);
  return ctx;
}

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
                [&] { ok = recv ? b->waitRecv(left(dl_)) : b->waitSend(left(dl_)); });
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

}  // namespace

// A failure of a peer's connection or a wait (Gloo's IoException) is fatal to the context and
// reported as a timeout naming what was waited for; a failed check of Gloo's (EnforceNotMet: the
// ranks disagree on the world or a collective's sizes) is DDP_ERR_MISMATCH; anything else
// DDP_ERR_INTERNAL. Neither of the last two is labelled a timeout. One check is the transport's own:
// its event loop refused a connection whose socket had just been closed (a peer died while this rank
// posted to it): that is the peer's loss, reported as the connection failures are.
void rethrow_gloo_failure(int rank, int size, const std::string& what) {
  try {
    throw;
  } catch (const gloo::IoException& e) {
    fail(DDP_ERR_TIMEOUT,
         "rank %d of %d: Gloo %s failed (a rank died, stalled past the timeout or issued a "
         "different collective): %s",
         rank, size, what.c_str(), e.what());
  } catch (const gloo::EnforceNotMet& e) {
    if (std::strstr(e.what(), "epoll_ctl") != nullptr)
      fail(DDP_ERR_TIMEOUT, "rank %d of %d: Gloo %s failed (a peer's connection closed under it: a rank died): %s",
           rank, size, what.c_str(), e.what());
    fail(DDP_ERR_MISMATCH,
         "rank %d of %d: Gloo %s failed a consistency check (the ranks disagree on the world size or on a "
         "collective's sizes): %s",
         rank, size, what.c_str(), e.what());
  } catch (const std::exception& e) {
    fail(DDP_ERR_INTERNAL, "rank %d of %d: Gloo %s failed: %s", rank, size, what.c_str(), e.what());
  }
}

// The job's join requests under a lineage's keys: "<lineage>.join/<slot>" holds a joiner's request,
// "<lineage>.join/<slot>/answer" the answer it waits for.
class GlooJoinDesk final : public JoinDesk {
 public:
  // `membership`: the key of the communicator whose members leave through this desk.
  GlooJoinDesk(std::shared_ptr<GlooWorld> w, std::string lineage, std::string membership = "")
      : world_(std::move(w)), lineage_(std::move(lineage)), membership_(std::move(membership)) {}
  bool request(int64_t slot, std::string* text) override {
    std::vector<char> v;
    if (!world_->rv.store->try_get(key(slot), &v, Deadline::after_ms(kStoreMs))) return false;
    text->assign(v.begin(), v.end());
    return true;
  }
  void answer(int64_t slot, const JoinAnswer& a) override {
    const std::string text = encode(a);
    std::vector<char> held;  // the first answer stands (a refusal told by several ranks alike)
    world_->rv.store->claim(key(slot) + "/answer", std::vector<char>(text.begin(), text.end()), &held,
                            Deadline::after_ms(kStoreMs));
  }
  bool answered(int64_t slot) override {
    std::vector<char> v;
    return world_->rv.store->try_get(key(slot) + "/answer", &v, Deadline::after_ms(kStoreMs));
  }
  bool beat(int64_t slot, std::string* value) override {
    std::vector<char> v;
    if (!world_->rv.store->try_get(key(slot) + "/beat", &v, Deadline::after_ms(kStoreMs))) return false;
    value->assign(v.begin(), v.end());
    return true;
  }
  // A fresh generation names this context's leave keys: a store that served an earlier job (a file
  // store's directory, a ddp_store left running) may hold the same keys from its members.
  void open(Deadline dl) override {
    std::random_device rd;
    const std::string gen = std::to_string((static_cast<uint64_t>(rd()) << 32) ^ rd() ^ now_ns());
    world_->rv.store->set(lineage_ + ".join/gen", std::vector<char>(gen.begin(), gen.end()), dl);
    world_->rv.store->set(ended_key(), {'0'}, dl);
  }
  // Each member claims its key of the membership, then looks for the others': whichever finds them all
  // (the last to claim does) sets the mark the joiners watch.
  void leave(int rank, int world, Deadline dl) override {
    Store& st = *world_->rv.store;
    std::vector<char> gen;
    st.try_get(lineage_ + ".join/gen", &gen, dl);
    const std::string base = lineage_ + ".join/left/" + std::string(gen.begin(), gen.end()) + "/" + membership_ + "/";
    std::vector<char> held, v;
    st.claim(base + std::to_string(rank), {'1'}, &held, dl);
    for (int r = 0; r < world; ++r)
      if (!st.try_get(base + std::to_string(r), &v, dl)) return;
    st.set(ended_key(), {'1'}, dl);
  }
  bool wait_request(int64_t slot, Deadline dl) override {
    Store::Seen seen;  // not filed yet
    world_->rv.store->wait_change(key(slot), &seen, dl, &stop_, 100);
    return true;
  }
  void stop_waiting() override {
    stop_ = true;
    world_->rv.store->interrupt();
  }
  std::string key(int64_t slot) const { return lineage_ + ".join/" + std::to_string(slot); }
  std::string ended_key() const { return lineage_ + ".join/ended"; }
  // Files `request` in the first free slot; returns the slot.
  int64_t file(const JoinRequest& request, Deadline dl) {
    const std::string text = encode(request);
    std::vector<char> held;
    int64_t slot = 0;
    while (!world_->rv.store->claim(key(slot), std::vector<char>(text.begin(), text.end()), &held, dl)) ++slot;
    return slot;
  }
  // Waits for the answer, bumping the heartbeat that tells the job this joiner still waits. The job's
  // end is an answer too, which the joiner files itself (so that a later job over this store passes
  // the request over).
  JoinAnswer wait_answer(int64_t slot, Deadline dl) {
    Store& st = *world_->rv.store;
    std::vector<char> v;
    for (uint64_t beat = 0;; ++beat) {
      if (st.try_get(key(slot) + "/answer", &v, dl)) {
        JoinAnswer a;
        if (!decode(std::string(v.begin(), v.end()), &a))
          fail(DDP_ERR_INTERNAL, "a malformed answer to a join: '%s'", std::string(v.begin(), v.end()).c_str());
        return a;
      }
      if (st.try_get(ended_key(), &v, dl) && v == std::vector<char>{'1'}) {
        answer(slot, JoinAnswer::job_ended());
        return JoinAnswer::job_ended();
      }
      if (dl.passed()) fail(DDP_ERR_TIMEOUT, "no answer in slot %lld", static_cast<long long>(slot));
      const std::string b = std::to_string(beat);
      st.set(key(slot) + "/beat", std::vector<char>(b.begin(), b.end()), dl);
      std::this_thread::sleep_for(Ms(100));
    }
  }

 private:
  static constexpr int64_t kStoreMs = 5000;
  std::shared_ptr<GlooWorld> world_;
  std::string lineage_, membership_;
  std::atomic<bool> stop_{false};
};

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
  std::unique_ptr<Comm> dup() override {
    return std::unique_ptr<Comm>(
        new GlooComm(world_, key_ + "." + std::to_string(++dups_), init_deadline(), rank(), size(), lineage_, abandoned_));
  }
  std::unique_ptr<Device> make_device() override { return std::unique_ptr<Device>(new HostDevice()); }
  std::unique_ptr<Prober> make_prober(std::function<Position()> mine) override {
    const Deadline dl = init_deadline();
    return make_socket_prober(*world_->rv.store, key_ + ".probe" + std::to_string(++dups_), rank(), size(),
                              world_->rv.host, std::move(mine), dl, [&] { barrier(dl); });
  }
  bool supports_wire(Dtype d) const override { return !is_16bit(d); }
  bool supports(RedOp op) const override { return op == RedOp::Sum || op == RedOp::SumScaled; }
  size_t buffer_bytes() const override { return ring_->bytes.load(); }
  size_t piece_elems(Dtype d, size_t bytes) const override {
    return std::max<size_t>(1, std::min(host::kRingMaxBytes, bytes ? bytes : piece_bytes_) / dtype_size(d));
  }

  void allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream&, Deadline dl) override {
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
  // The 16-bit wires on f32 buckets: the ring from the ring's sizes on, else every rank's cast
  // elements gathered and summed in rank order.
  bool can_cast_ring() const override { return true; }
  void allreduce_as(const void* send, void* recv, size_t n, Dtype d, Dtype wire, Reduction red, Stream&,
                    Deadline dl) override {
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
  void reduce_scatter(void* buf, size_t m, Dtype d, Reduction red, Stream&, Deadline dl) override {
    const double factor = sum_factor(red);
    char* p = static_cast<char*>(buf);
    if (size() == 1) return host::convert(p, d, p, d, m, factor);
    host::RingBuffer& ring = *ring_;
    const size_t piece = piece_bytes_;
    run_ring(dl, [&](GlooRingLink& link) { host::ring_reduce_scatter(link, ring, p, m, d, factor, piece); });
  }
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
  void broadcast_host(void* buf, size_t bytes, int root, Deadline dl) override {
    if (root < 0 || root >= size())
      fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size() - 1);
    if (size() == 1 || bytes == 0) return;
    usable();
    guarded([&] {
      gloo_call(rank(), size(), format("broadcast from rank %d", root), [&] {
        gloo::BroadcastOptions o(ctx_);
        o.setOutput(static_cast<uint8_t*>(buf), bytes);
        o.setRoot(root);
        o.setTimeout(left(dl));
        gloo::broadcast(o);
      });
    });
    wire_bytes()->broadcast(bytes, size(), rank(), root);
  }
  void allgather_host(const void* in, void* out, size_t bytes, Deadline dl) override {
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
        o.setTimeout(left(dl));
        gloo::allgather(o);
      });
    });
    wire_bytes()->allgather(bytes, size());
  }
  void abort() override { aborted_ = true; }
  bool can_regroup() const override { return true; }
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
                              double factor) {
    const int world = link.size();
    const size_t bytes = k * dtype_size(d);
    char* all = ring.ensure(bytes * static_cast<size_t>(world));
    std::memcpy(all + static_cast<size_t>(link.rank()) * bytes, from, bytes);
    host::ring_allgather(link, all, bytes);
    host::convert(all, d, to, d, k, 1.0);
    for (int r = 1; r < world; ++r)
      host::sum_scaled(to, all + static_cast<size_t>(r) * bytes, to, k, d, r == world - 1 ? factor : 1.0);
  }
  void barrier(Deadline dl) {
    gloo_call(rank(), size(), "barrier", [&] {
      gloo::BarrierOptions b(ctx_);
      b.setTimeout(left(dl));
      gloo::barrier(b);
    });
  }

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

// An agreement is named "E.K": membership E, attempt K. A survivor whose attempt failed later than
// another's (it waited longer for a rank that died in the middle of the recovery) would otherwise
// retry under a lower attempt than the others and never meet them: each agreement goes to the latest
// attempt of E in which any rank has checked in, if that is later than its own, and never to one
// this rank tried already.
std::string GlooComm::latest_attempt(const std::string& epoch, Deadline dl) {
  const size_t dot = epoch.rfind('.');
  if (dot == std::string::npos) return epoch;
  const std::string e = epoch.substr(0, dot + 1);
  long long k = std::atoll(epoch.c_str() + dot + 1);
  if (e == tried_epoch_) k = std::max(k, tried_attempt_ + 1);
  for (bool started = true; started;) {
    started = false;
    std::vector<char> v;
    for (int r = 0; r < size() && !started; ++r)
      started = world_->rv.store->try_get(key_ + ".e" + e + std::to_string(k + 1) + "/in/" + std::to_string(r), &v, dl);
    if (started) ++k;
  }
  tried_epoch_ = e;
  tried_attempt_ = k;
  return e + std::to_string(k);
}

// The survivors agree through the store (host/membership.hpp); the new Gloo context meets under the
// membership's prefix.
Regrouped GlooComm::regroup(const std::string& requested, int64_t committed,
                            const std::function<std::vector<Liveness>()>& answering, Deadline window, Deadline dl) {
  const std::string epoch = latest_attempt(requested, dl);
  const std::string base = key_ + ".e" + epoch;
  Agreed a;
  try {
    a = agree_membership(*world_->rv.store, base, epoch, rank(), size(), committed, answering, window, dl);
  } catch (const Error& e) {
    // A membership claimed after this rank gave up may hold it: its creation must not wait for it.
    if (e.status() != DDP_ERR_RANK_LOST) mark_abandoned(*world_->rv.store, base + "/abandoned", "old rank " + std::to_string(rank()));
    throw;
  }
  Regrouped g;
  g.members = a.members;
  g.committed = a.committed;
  g.comm.reset(new GlooComm(world_, base + ".c", dl, a.me, static_cast<int>(a.members.size()), lineage_,
                            base + "/abandoned"));
  return g;
}

// Rank 0 tells each joiner where the new membership meets (its number and the new world) before
// every rank meets there.
std::unique_ptr<Comm> GlooComm::admit(const std::string& name, const std::vector<int64_t>& slots,
                                      const std::string& note, Deadline dl) {
  const std::string key = key_ + ".j" + name;
  const int world = size() + static_cast<int>(slots.size());
  if (rank() == 0) {
    GlooJoinDesk desk(world_, lineage_);
    for (size_t i = 0; i < slots.size(); ++i)
      desk.answer(slots[i], JoinAnswer::admitted(key, size() + static_cast<int>(i), world, note));
  }
  return std::unique_ptr<Comm>(new GlooComm(world_, key, dl, rank(), world, lineage_, key + "/abandoned"));
}

// A joiner's communicator: the store of a running job and nothing else until the job admits it.
class GlooJoiningComm final : public Comm {
 public:
  GlooJoiningComm(std::shared_ptr<GlooWorld> w, std::string lineage)
      : world_(std::move(w)), lineage_(std::move(lineage)) {}
  int rank() const override { return -1; }
  int size() const override { return 0; }
  Memory memory() const override { return Memory::Host; }
  std::unique_ptr<Comm> dup() override { return std::unique_ptr<Comm>(new GlooJoiningComm(world_, lineage_)); }
  std::unique_ptr<Device> make_device() override { return std::unique_ptr<Device>(new HostDevice()); }
  bool supports_wire(Dtype d) const override { return !is_16bit(d); }
  bool supports(RedOp op) const override { return op == RedOp::Sum || op == RedOp::SumScaled; }
  void allreduce(const void*, void*, size_t, Dtype, Reduction, Stream&, Deadline) override { not_admitted(); }
  void broadcast(void*, size_t, int, void*, Deadline) override { not_admitted(); }
  void allgather_host(const void*, void*, size_t, Deadline) override { not_admitted(); }
  void broadcast_host(void*, size_t, int, Deadline) override { not_admitted(); }
  bool can_regroup() const override { return true; }
  bool joining() const override { return true; }
  // Waits for the admission within this communicator's own bound (ddp_comm_join_gloo's timeout_ms),
  // which the request carries so that the job passes over a joiner that stopped waiting.
  JoinOutcome join(const JoinTerms& terms, Deadline dl) override {
    const int64_t bound = world_->init_timeout_ms;
    dl = Deadline::earlier(dl, Deadline::after_ms(bound));
    const JoinRequest request = JoinRequest::of_this_process(terms, bound);
    GlooJoinDesk desk(world_, lineage_);
    JoinOutcome out;
    out.job = world_->rv.describe;
    int64_t slot = 0;
    try {
      do {  // passed over (the job saw its heartbeat stand still): ask again
        slot = desk.file(request, dl);
        out.answer = desk.wait_answer(slot, dl);
      } while (out.answer.kind == JoinAnswer::Kind::PassedOver);
    } catch (const Error& e) {
      if (e.status() != DDP_ERR_TIMEOUT) throw;
      fail(DDP_ERR_TIMEOUT,
           "no running elastic job at %s admitted this process before the timeout (its request waits as '%s'): is "
           "the job running with config.elastic over this rendezvous, and still training? (ranks are admitted "
           "after a synced iteration)",
           world_->rv.describe.c_str(), desk.key(slot).c_str());
    }
    if (out.answer.kind != JoinAnswer::Kind::Admitted) return out;
    // The job waits kJoinArriveMs for its joiners to arrive, then goes on without them if one never
    // came (another joiner of the same admission died): this one then asks again rather than wait out
    // its own bound.
    const Deadline arrive = Deadline::earlier(dl, Deadline::after_ms(kJoinArriveMs + kJoinArriveSlackMs));
    out.comm.reset(new GlooComm(world_, out.answer.meet, arrive, out.answer.rank, out.answer.world, lineage_,
                                out.answer.meet + "/abandoned"));
    return out;
  }

 private:
  [[noreturn]] static void not_admitted() {
    fail(DDP_ERR_INVALID_STATE, "a joiner's communicator has no ranks until the job admits it (ddp_recover)");
  }
  std::shared_ptr<GlooWorld> world_;
  std::string lineage_;
};

namespace {

// The worlds in use, by init method, rank and size: a second communicator made the same way meets
// over the same store (rank 0 cannot listen twice on one port) as the next communicator of that world.
// Each name has its own lock, held while its world is opened: ranks that are threads of one process
// open their worlds at once (rank 1 waits for rank 0's store while rank 0 starts it).
struct WorldSlot {
  std::mutex mu;
  std::weak_ptr<GlooWorld> world;
};
std::mutex g_worlds_mu;
std::map<std::string, std::shared_ptr<WorldSlot>> g_worlds;

// `joining`: a process that joins a running elastic job (its own world of joining communicators).
std::shared_ptr<GlooWorld> open_world(const char* init_method, int rank, int size, int64_t timeout_ms, Deadline dl,
                                      bool joining = false) {
  // The same world whether its method or rank is named or left to the defaults and the environment.
  auto env = [](const char* k) { return knobs::text(k); };
  const std::string name = (init_method && *init_method ? init_method : "env://") + std::string("|") +
                           (joining ? std::string("joining")
                                    : (rank >= 0 ? std::to_string(rank) : env("RANK")) + "|" +
                                          (size >= 0 ? std::to_string(size) : env("WORLD_SIZE")));
  std::shared_ptr<WorldSlot> slot;
  {
    std::lock_guard<std::mutex> lock(g_worlds_mu);
    std::shared_ptr<WorldSlot>& s = g_worlds[name];
    if (!s) s = std::make_shared<WorldSlot>();
    slot = s;
  }
  std::lock_guard<std::mutex> lock(slot->mu);
  if (std::shared_ptr<GlooWorld> w = slot->world.lock()) return w;
  auto w = std::make_shared<GlooWorld>();
  w->rv = joining ? open_joining_store(init_method, dl) : open_rendezvous(init_method, rank, size, dl);
  w->init_timeout_ms = timeout_ms;
  w->settled = joining;  // a joiner made no arrival
  gloo::transport::tcp::attr attr;
  const std::string iface = knobs::text("GLOO_SOCKET_IFNAME");
  if (!iface.empty()) {
    attr.iface = iface;
    // The stall inspector's port is reached where Gloo is (the store's address or the host name may
    // be another interface's, out of the peers' reach).
    const std::string a = tcp::interface_address(iface);
    if (!a.empty()) w->rv.host = a;
  } else
    attr.hostname = w->rv.host;  // the interface that reaches rank 0 (empty: the host's name)
  gloo_call(w->rv.rank, w->rv.size, "device on " + (attr.iface.empty() ? attr.hostname : attr.iface),
            [&] { w->device = gloo::transport::tcp::CreateDevice(attr); });
  slot->world = w;
  return w;
}

}  // namespace

std::unique_ptr<Comm> make_gloo_comm(const char* init_method, int rank, int size, int64_t timeout_ms) {
  const Deadline dl = Deadline::after_ms(timeout_ms);
  std::shared_ptr<GlooWorld> w = open_world(init_method, rank, size, timeout_ms, dl);
  const int n = w->comms++;
  return std::unique_ptr<Comm>(new GlooComm(w, "c" + std::to_string(n), dl, w->rv.rank, w->rv.size));
}

// Every joiner asks the contexts made over the job's first communicator ("c0": what a rank's first
// ddp_comm_init_gloo makes), however many joiners one process holds.
std::unique_ptr<Comm> make_gloo_join_comm(const char* init_method, int64_t timeout_ms) {
  const Deadline dl = Deadline::after_ms(timeout_ms);
  std::shared_ptr<GlooWorld> w = open_world(init_method, -1, 0, timeout_ms, dl, true);
  return std::unique_ptr<Comm>(new GlooJoiningComm(w, "c0"));
}

bool have_gloo() { return true; }

}  // namespace ddp
