// The Store's ways that every store has, in terms of its single-key calls: a store that can do better
// (the TCP store: one request for many keys, a server that answers when a key changes) overrides them.
#include "host/store.hpp"

#include <algorithm>
#include <chrono>
#include <thread>

namespace ddp {

std::vector<std::vector<char>> Store::get_many(const std::vector<std::string>& keys, Deadline dl, const Who& who) {
  std::vector<std::vector<char>> out;
  out.reserve(keys.size());
  for (const std::string& k : keys) out.push_back(get(k, dl, who(k)));
  return out;
}

std::vector<std::vector<char>> Store::get_many(const std::vector<std::string>& keys, Deadline dl,
                                               const std::string& who) {
  return get_many(keys, dl, [&who](const std::string&) { return who; });
}

void Store::wait(const std::vector<std::string>& keys, Deadline dl, const Who& who) { get_many(keys, dl, who); }

bool Store::watch(const std::vector<std::string>& keys, std::vector<Seen>* seen, Deadline dl,
                  const std::atomic<bool>* stop, int look_ms) {
  std::vector<Seen> now(keys.size());
  for (;;) {
    bool changed = false;
    for (size_t i = 0; i < keys.size(); ++i) {
      now[i].set = try_get(keys[i], &now[i].value, dl);
      if (!now[i].set) now[i].value.clear();
      const Seen& was = (*seen)[i];
      changed = changed || now[i].set != was.set || (now[i].set && now[i].value != was.value);
    }
    if (changed) {
      *seen = std::move(now);
      return true;
    }
    if (dl.passed() || (stop && stop->load())) return false;
    const auto left = dl.infinite()
                          ? std::chrono::milliseconds(look_ms)
                          : std::chrono::duration_cast<std::chrono::milliseconds>(dl.at() - Deadline::Clock::now());
    std::this_thread::sleep_for(
        std::max(std::chrono::milliseconds(0), std::min(left, std::chrono::milliseconds(look_ms))));
  }
}

bool Store::wait_change(const std::string& key, Seen* seen, Deadline dl, const std::atomic<bool>* stop, int look_ms) {
  std::vector<Seen> s(1, *seen);
  if (!watch({key}, &s, dl, stop, look_ms)) return false;
  *seen = std::move(s[0]);
  return true;
}

}  // namespace ddp
