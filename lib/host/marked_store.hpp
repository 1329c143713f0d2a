// A store whose waits also end when a mark is set: the members of an elastic membership being
// formed wait for each other's keys through it, and a member that gives up on the membership sets
// the mark, so that the others stop waiting for keys it will never set (docs/design.md, "Elastic
// membership").
#pragma once

#include <string>

#include "host/store.hpp"

namespace ddp {

class MarkedStore final : public Store {
 public:
  // Over `inner`, which must outlive it; `mark`: the key whose setting ends every wait.
  MarkedStore(Store& inner, std::string mark) : inner_(inner), mark_(std::move(mark)) {}

  void set(const std::string& key, const std::vector<char>& value, Deadline dl) override { inner_.set(key, value, dl); }
  // Waits as the inner store does, but fails with DDP_ERR_ABORTED, naming who set the mark (its
  // value), as soon as the mark is set.
  std::vector<char> get(const std::string& key, Deadline dl, const std::string& who) override;
  bool claim(const std::string& key, const std::vector<char>& value, std::vector<char>* held, Deadline dl) override {
    return inner_.claim(key, value, held, dl);
  }
  bool try_get(const std::string& key, std::vector<char>* out, Deadline dl) override {
    return inner_.try_get(key, out, dl);
  }
  void erase(const std::string& key) override { inner_.erase(key); }
  using Store::get_many;
  std::vector<std::vector<char>> get_many(const std::vector<std::string>& keys, Deadline dl, const Who& who) override;
  void wait(const std::vector<std::string>& keys, Deadline dl, const Who& who) override { get_many(keys, dl, who); }
  bool watch(const std::vector<std::string>& keys, std::vector<Seen>* seen, Deadline dl,
             const std::atomic<bool>* stop = nullptr, int look_ms = 10) override {
    return inner_.watch(keys, seen, dl, stop, look_ms);
  }
  void interrupt() override { inner_.interrupt(); }

  // Sets the mark in `store` (best effort, a second at most: the store may be what failed); `who`
  // names this rank in the others' message.
  static void mark(Store& store, const std::string& mark, const std::string& who);

 private:
  Store& inner_;
  std::string mark_;
};

}  // namespace ddp
