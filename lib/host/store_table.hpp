// What the TCP store's server holds: the keys, and the requests that wait for keys (a Get until every
// key it names is set, a Watch until one of its keys changes). A waiting request is filed under the
// keys it waits for, so that a set looks at the requests waiting for that key and at no other: nothing
// is looked at again on a timer, and a key nobody waits for costs nothing to set. One thread owns a
// table (the server's event loop); answers leave through `send`. The frames: host/store_wire.hpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace ddp {

namespace store_wire {
class Reader;
}

class StoreTable {
 public:
  using Clock = std::chrono::steady_clock;
  // An answer for connection `conn`: a whole frame.
  using Send = std::function<void(uint64_t conn, std::string frame)>;

  explicit StoreTable(Send send) : send_(std::move(send)) {}
  // One request of connection `conn` (a frame's body): false when it is malformed (the server then
  // closes the connection).
  bool handle(uint64_t conn, const char* body, size_t n);
  // Connection `conn` closed: its waiting requests are forgotten.
  void drop(uint64_t conn);
  // Answers the waiting requests whose bound passed by `now`; returns the next bound (max(): none).
  Clock::time_point expire(Clock::time_point now);
  // Waiting requests looked at because a key they wait for was set (each answered or filed again).
  uint64_t wakeups() const { return wakeups_; }
  size_t waiting() const { return waiters_.size(); }

 private:
  struct Known {
    bool set = false;
    std::vector<char> value;
  };
  struct Waiter {
    uint64_t conn = 0;
    uint32_t id = 0;
    bool watch = false;   // a Watch; else a Get
    bool values = false;  // a Get that answers with the values
    size_t next = 0;      // a Get: its first key not seen set yet (the key it is filed under)
    std::vector<std::string> keys;
    std::vector<Known> known;  // a Watch: what the client saw of each key
    std::multimap<Clock::time_point, uint64_t>::iterator timer;
    bool timed = false;
  };

  bool wait_for(uint64_t conn, uint32_t id, bool watch, store_wire::Reader& r);
  // Files a waiting request (its bound `wait_ms`, store_wire::kForever for none).
  void park(uint64_t conn, uint32_t id, uint32_t wait_ms, Waiter w);
  void set(const std::string& key, std::vector<char> value);
  // The requests filed under `key` after it was set: each answered, or filed again.
  void wake(const std::string& key);
  bool advance(Waiter& w) const;  // a Get: true once every key is set
  bool changed(const Waiter& w) const;
  void answer(const Waiter& w);
  void answer_late(const Waiter& w);  // at its bound
  void remove(uint64_t serial);

  Send send_;
  std::unordered_map<std::string, std::vector<char>> kv_;
  std::map<uint64_t, Waiter> waiters_;  // by serial, in the order they came
  uint64_t next_serial_ = 1;
  std::unordered_map<std::string, std::set<uint64_t>> filed_;     // key -> the waiters filed under it
  std::map<std::pair<uint64_t, uint32_t>, uint64_t> by_request_;  // (connection, id) -> serial
  std::multimap<Clock::time_point, uint64_t> timers_;
  uint64_t wakeups_ = 0;
};

}  // namespace ddp
