// A Gloo context's full mesh (gloo_mesh.hpp): Gloo's own connectFullMesh over our store, then a
// barrier. docs/design.md, "Elastic membership".
#include "backends/gloo/gloo_mesh.hpp"

#include <gloo/barrier.h>

#include <atomic>
#include <exception>
#include <thread>

#include "host/host_device.hpp"
#include "host/marked_store.hpp"

namespace ddp {

namespace {

// Gloo's store interface over ours: keys under a prefix, waits bounded by the creation's deadline;
// remembers the keys this rank set, to erase them once every rank has read them. A creation over an
// elastic membership waits through a MarkedStore: it ends as soon as a member gives up on it (its
// keys would never come, and the others would wait out the deadline while it went on to the next
// attempt without them).
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(ddp::Store& s, std::string prefix, Deadline dl, const std::string& abandoned)
      : marked_(s, abandoned), s_(abandoned.empty() ? s : marked_), prefix_(std::move(prefix)), dl_(dl) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    s_.set(prefix_ + key, data, dl_);
    mine_.push_back(prefix_ + key);
  }
  std::vector<char> get(const std::string& key) override { return s_.get(prefix_ + key, dl_, who(key)); }
  void wait(const std::vector<std::string>& keys) override {
    std::vector<std::string> mine;
    for (const std::string& k : keys) mine.push_back(prefix_ + k);
    s_.wait(mine, dl_, [](const std::string& k) { return who(k); });  // one request, no values
  }
  void wait(const std::vector<std::string>& keys, const GlooMs&) override { wait(keys); }
  void erase_mine() {
    for (const std::string& k : mine_) s_.erase(k);
  }

 private:
  // Gloo's keys end in the rank that sets them.
  static std::string who(const std::string& key) {
    const size_t i = key.find_last_not_of("0123456789");
    return i + 1 < key.size() ? "rank " + key.substr(i + 1) : "a rank";
  }
  MarkedStore marked_;
  ddp::Store& s_;
  std::string prefix_;
  Deadline dl_;
  std::vector<std::string> mine_;
};

// Gloo's mesh and a first barrier over it.
void connect_mesh(GlooWorld& w, const std::shared_ptr<gloo::rendezvous::Context>& ctx, StoreAdapter& adapter,
                  Deadline dl) {
  gloo_call(ctx->rank, ctx->size, "connection of the ranks' mesh (" + w.rv.describe + ")", [&] {
    ctx->connectFullMesh(adapter, w.device);
    gloo::BarrierOptions b(ctx);
    b.setTimeout(gloo_left(dl));
    gloo::barrier(b);
  });
}

// An elastic membership's mesh, given up as soon as a member gives up on it. Gloo's wait for a peer's
// first connection cannot be interrupted (a member that died after it published its address leaves
// the others waiting to the deadline, while the member that saw the refusal goes on to the next
// attempt without them): the mesh is made on a thread of its own, and this one watches the store for
// the mark. A mesh given up on is left to its thread, which ends at the deadline.
void connect_mesh_abandonable(const std::shared_ptr<GlooWorld>& w,
                              const std::shared_ptr<gloo::rendezvous::Context>& ctx,
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
    if (!changed && !out->done.load()) std::this_thread::sleep_for(GlooMs(10));  // past the deadline: Gloo's own end
  }
  if (out->error) std::rethrow_exception(out->error);
}

}  // namespace

std::shared_ptr<gloo::Context> connect_context(const std::shared_ptr<GlooWorld>& w, const std::string& key, Deadline dl,
                                               int rank, int size, const std::string& abandoned) {
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  // Gloo waits five times the context's timeout for a pair's first connection (a peer that died in
  // the rendezvous): a fifth of what is left, so that the whole creation ends within `dl`.
  ctx->setTimeout(GlooMs(std::max<int64_t>(1, tcp::ms_left(dl, kGlooForeverMs) / 5)));
  auto adapter = std::make_shared<StoreAdapter>(*w->rv.store, key + "/", dl, abandoned);
  try {
    if (abandoned.empty())
      connect_mesh(*w, ctx, *adapter, dl);
    else
      connect_mesh_abandonable(w, ctx, adapter, abandoned, dl);
  } catch (const Error&) {
    MarkedStore::mark(*w->rv.store, abandoned, "rank " + std::to_string(rank) + " of the new membership");
    throw;
  }
  adapter->erase_mine();  // after the barrier every rank has read them
  if (!w->settled.exchange(true)) settle_rendezvous(w->rv);
  return ctx;
}
}  // namespace ddp
