// Joining a running elastic job over Gloo: the job's join desk in the store, and a joiner's
// communicator, which holds nothing but the store until the job admits it (gloo_join.cpp).
#pragma once

#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "backends/gloo/gloo_world.hpp"
#include "core/comms.hpp"
#include "core/join_protocol.hpp"

namespace ddp {

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
      std::this_thread::sleep_for(GlooMs(100));
    }
  }

 private:
  static constexpr int64_t kStoreMs = 5000;
  std::shared_ptr<GlooWorld> world_;
  std::string lineage_, membership_;
  std::atomic<bool> stop_{false};
};

// A joiner's communicator (ddp_comm_join_gloo) over the job's first communicator's lineage.
std::unique_ptr<Comm> make_gloo_joining_comm(std::shared_ptr<GlooWorld> w, std::string lineage);

}  // namespace ddp
