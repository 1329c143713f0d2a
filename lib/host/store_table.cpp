#include "host/store_table.hpp"

#include "host/store_wire.hpp"

namespace ddp {

namespace w = store_wire;

bool StoreTable::handle(uint64_t conn, const char* body, size_t n) {
  w::Reader r(body, n);
  const uint8_t op = r.u8();
  const uint32_t id = r.u32();
  if (op == w::kSet || op == w::kClaim) {
    std::string key = r.str();
    std::vector<char> value = r.blob();
    if (!r.done()) return false;
    auto it = kv_.find(key);
    w::Writer a;
    a.u32(id);
    if (op == w::kClaim && it != kv_.end()) {  // lost: the value held
      send_(conn, a.u8(0).blob(it->second).frame());
      return true;
    }
    if (op == w::kClaim) a.u8(1);
    send_(conn, a.frame());
    set(key, std::move(value));
    return true;
  }
  if (op == w::kTry) {
    const std::string key = r.str();
    if (!r.done()) return false;
    auto it = kv_.find(key);
    w::Writer a;
    a.u32(id).u8(it != kv_.end() ? 1 : 0);
    if (it != kv_.end()) a.blob(it->second);
    send_(conn, a.frame());
    return true;
  }
  if (op == w::kCancel) {
    const uint32_t target = r.u32();
    if (!r.done()) return false;
    auto it = by_request_.find({conn, target});
    if (it != by_request_.end()) remove(it->second);
    return true;
  }
  if (op != w::kGet && op != w::kWatch) return false;
  return wait_for(conn, id, op == w::kWatch, r);
}

// A Get or a Watch: answered now if it can be, else filed.
bool StoreTable::wait_for(uint64_t conn, uint32_t id, bool watch, w::Reader& r) {
  Waiter wt;
  wt.conn = conn, wt.id = id, wt.watch = watch;
  const uint32_t wait_ms = r.u32();
  if (!watch) wt.values = r.u8() != 0;
  const uint32_t count = r.u32();
  for (uint32_t i = 0; i < count && r.ok(); ++i) {
    wt.keys.push_back(r.str());
    if (!watch) continue;
    Known k;
    k.set = r.u8() != 0;
    if (k.set) k.value = r.blob();
    wt.known.push_back(std::move(k));
  }
  if (!r.done()) return false;
  if (watch ? changed(wt) : advance(wt))
    answer(wt);
  else
    park(conn, id, wait_ms, std::move(wt));
  return true;
}

void StoreTable::park(uint64_t conn, uint32_t id, uint32_t wait_ms, Waiter wt) {
  auto old = by_request_.find({conn, id});  // an id used again: the client forgot the first request
  if (old != by_request_.end()) remove(old->second);
  if (wait_ms == 0) return answer_late(wt);
  const uint64_t serial = next_serial_++;
  if (wait_ms != w::kForever) {
    wt.timer = timers_.emplace(Clock::now() + std::chrono::milliseconds(wait_ms), serial);
    wt.timed = true;
  }
  if (wt.watch)
    for (const std::string& k : wt.keys) filed_[k].insert(serial);
  else
    filed_[wt.keys[wt.next]].insert(serial);
  by_request_[{conn, id}] = serial;
  waiters_.emplace(serial, std::move(wt));
}

void StoreTable::set(const std::string& key, std::vector<char> value) {
  kv_[key] = std::move(value);
  wake(key);
}

void StoreTable::wake(const std::string& key) {
  auto it = filed_.find(key);
  if (it == filed_.end()) return;
  const std::set<uint64_t> serials = std::move(it->second);
  filed_.erase(it);
  for (uint64_t s : serials) {
    auto wi = waiters_.find(s);
    if (wi == waiters_.end()) continue;
    ++wakeups_;
    Waiter& wt = wi->second;
    if (wt.watch ? changed(wt) : advance(wt)) {
      answer(wt);
      remove(s);
    } else {
      filed_[wt.watch ? key : wt.keys[wt.next]].insert(s);  // (a Watch: the same value set again)
    }
  }
}

bool StoreTable::advance(Waiter& wt) const {
  while (wt.next < wt.keys.size() && kv_.count(wt.keys[wt.next])) ++wt.next;
  return wt.next == wt.keys.size();
}

bool StoreTable::changed(const Waiter& wt) const {
  for (size_t i = 0; i < wt.keys.size(); ++i) {
    auto it = kv_.find(wt.keys[i]);
    const bool set = it != kv_.end();
    if (set != wt.known[i].set || (set && it->second != wt.known[i].value)) return true;
  }
  return false;
}

void StoreTable::answer(const Waiter& wt) {
  w::Writer a;
  a.u32(wt.id).u8(1);
  if (wt.watch) {
    for (const std::string& k : wt.keys) {
      auto it = kv_.find(k);
      a.u8(it != kv_.end() ? 1 : 0);
      if (it != kv_.end()) a.blob(it->second);
    }
  } else if (wt.values) {
    for (const std::string& k : wt.keys) a.blob(kv_.at(k));
  }
  send_(wt.conn, a.frame());
}

void StoreTable::answer_late(const Waiter& wt) {
  w::Writer a;
  a.u32(wt.id).u8(0);
  if (!wt.watch) a.u32(static_cast<uint32_t>(wt.next));
  send_(wt.conn, a.frame());
}

void StoreTable::remove(uint64_t serial) {
  auto wi = waiters_.find(serial);
  if (wi == waiters_.end()) return;
  const Waiter& wt = wi->second;
  auto unfile = [&](const std::string& k) {
    auto f = filed_.find(k);
    if (f == filed_.end()) return;
    f->second.erase(serial);
    if (f->second.empty()) filed_.erase(f);
  };
  if (wt.watch)
    for (const std::string& k : wt.keys) unfile(k);
  else if (wt.next < wt.keys.size())
    unfile(wt.keys[wt.next]);
  if (wt.timed) timers_.erase(wt.timer);
  by_request_.erase({wt.conn, wt.id});
  waiters_.erase(wi);
}

void StoreTable::drop(uint64_t conn) {
  std::vector<uint64_t> serials;
  for (auto it = by_request_.lower_bound({conn, 0}); it != by_request_.end() && it->first.first == conn; ++it)
    serials.push_back(it->second);
  for (uint64_t s : serials) remove(s);
}

StoreTable::Clock::time_point StoreTable::expire(Clock::time_point now) {
  while (!timers_.empty() && timers_.begin()->first <= now) {
    const uint64_t s = timers_.begin()->second;
    auto wi = waiters_.find(s);
    if (wi == waiters_.end()) {
      timers_.erase(timers_.begin());
      continue;
    }
    answer_late(wi->second);
    remove(s);
  }
  return timers_.empty() ? Clock::time_point::max() : timers_.begin()->first;
}

}  // namespace ddp
