#include "host/marked_store.hpp"

namespace ddp {

std::vector<char> MarkedStore::get(const std::string& key, Deadline dl, const std::string& who) {
  return get_many({key}, dl, [&who](const std::string&) { return who; }).front();
}

// One watch of the keys and the mark, again after each change, until every key is there.
std::vector<std::vector<char>> MarkedStore::get_many(const std::vector<std::string>& keys, Deadline dl,
                                                     const Who& who) {
  std::vector<std::string> all(keys);
  all.push_back(mark_);
  std::vector<Seen> seen(all.size());
  for (;;) {
    if (seen.back().set)
      fail(DDP_ERR_ABORTED, "%s gave up on this membership (a member was lost while it was being formed)",
           std::string(seen.back().value.begin(), seen.back().value.end()).c_str());
    size_t missing = 0;
    while (missing < keys.size() && seen[missing].set) ++missing;
    if (missing == keys.size()) break;
    if (!inner_.watch(all, &seen, dl)) return inner_.get_many(keys, dl, who);  // (at the deadline: its timeout)
  }
  std::vector<std::vector<char>> values;
  values.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) values.push_back(std::move(seen[i].value));
  return values;
}

void MarkedStore::mark(Store& store, const std::string& mark, const std::string& who) {
  if (mark.empty()) return;
  try {
    store.set(mark, std::vector<char>(who.begin(), who.end()), Deadline::after_ms(1000));
  } catch (...) {
  }
}

}  // namespace ddp
