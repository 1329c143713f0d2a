#include "host/membership.hpp"

#include <algorithm>
#include <cstdlib>

namespace ddp {

namespace {

std::vector<char> bytes(const std::string& t) { return std::vector<char>(t.begin(), t.end()); }

// Takes in the check-ins still missing from `in` that are there by `until`: one request, which the
// store answers as soon as one of them comes.
void take_check_ins(Store& store, const std::string& base, std::vector<int64_t>& in, Deadline until) {
  std::vector<std::string> keys;
  std::vector<size_t> ranks;
  for (size_t r = 0; r < in.size(); ++r)
    if (in[r] < 0) keys.push_back(base + "/in/" + std::to_string(r)), ranks.push_back(r);
  std::vector<Store::Seen> seen(keys.size());
  if (keys.empty() || !store.watch(keys, &seen, until)) return;
  for (size_t i = 0; i < keys.size(); ++i)
    if (seen[i].set) in[ranks[i]] = std::atoll(std::string(seen[i].value.begin(), seen[i].value.end()).c_str());
}

// The check-ins: in[r] is the iterations rank r committed, -1 while it has not checked in. Returns
// when every rank checked in or was taken for lost (silent_asks), or at `window`; meanwhile the ranks
// are asked every 100 ms whether they answer, and the store is waited on between the asks.
std::vector<int64_t> wait_check_ins(Store& store, const std::string& base, int rank, int n,
                                    const std::function<std::vector<Liveness>()>& answering, Deadline window,
                                    Deadline dl) {
  std::vector<int64_t> in(static_cast<size_t>(n), -1);
  std::vector<int> silent(static_cast<size_t>(n), 0);  // asks in a row without an answer
  uint64_t next_ask = 0;
  for (Deadline until = Deadline::after_ms(1);;) {  // the first look does not wait
    take_check_ins(store, base, in, until);
    int waiting = 0;
    for (size_t r = 0; r < in.size(); ++r)
      if (in[r] < 0 && silent[r] < kLostAfterAsks) ++waiting;
    if (waiting == 0 || window.passed()) return in;
    if (dl.passed()) fail(DDP_ERR_TIMEOUT, "rank %d: the ranks did not agree on a membership in time", rank);
    if (now_ns() >= next_ask) {
      const std::vector<Liveness> alive = answering();
      for (size_t r = 0; r < silent.size(); ++r) silent[r] = silent_asks(silent[r], alive[r]);
      next_ask = now_ns() + 100 * 1000000ull;
    }
    const int64_t to_ask = static_cast<int64_t>((next_ask - std::min(next_ask, now_ns())) / 1000000) + 1;
    until = Deadline::earlier(Deadline::earlier(dl, window), Deadline::after_ms(to_ask));
  }
}

// Every rank as this one sees it now (asked twice when one is silent): a rank cut off from this one
// may still have reached the store (a shared file system) and checked in.
std::vector<Liveness> reached(int rank, const std::function<std::vector<Liveness>()>& answering) {
  std::vector<Liveness> now = answering();
  if (std::find(now.begin(), now.end(), Liveness::Silent) != now.end()) {
    const std::vector<Liveness> again = answering();
    for (size_t r = 0; r < now.size(); ++r)
      if (again[r] != Liveness::Silent) now[r] = again[r];
  }
  now[static_cast<size_t>(rank)] = Liveness::Alive;
  return now;
}

// Proposes the ranks that checked in and are reached ("rank:committed ..."), or, when they are no
// more than half of the ranks not known to be gone (the smaller side of a cut, or an even split),
// waits for the other side's proposal; returns the one the store kept. (A rank that ended its own
// recovery already shows as gone: its proposal is in the store.)
std::string claim_members(Store& store, const std::string& key, int rank, const std::vector<int64_t>& in,
                          const std::vector<Liveness>& reach, Deadline dl) {
  std::string view;
  int counted = 0, seen = 0;
  for (size_t r = 0; r < in.size(); ++r) {
    if (reach[r] == Liveness::Gone) continue;
    ++counted;
    if (in[r] < 0 || reach[r] != Liveness::Alive) continue;
    ++seen;
    view += std::to_string(r) + ":" + std::to_string(in[r]) + " ";
  }
  std::vector<char> held;
  if (2 * seen > counted) {
    if (!store.claim(key, bytes(view), &held, dl)) view.assign(held.begin(), held.end());
    return view;
  }
  try {
    held = store.get(key, dl, "a membership from the ranks this one cannot reach");
  } catch (const Error& e) {
    if (e.status() != DDP_ERR_TIMEOUT) throw;
    fail(DDP_ERR_TIMEOUT,
         "rank %d reaches %d of the %d ranks still there (the network is split, or they stall): no side holds "
         "a majority, and no membership was agreed before the deadline",
         rank, seen, counted);
  }
  return std::string(held.begin(), held.end());
}

}  // namespace

Agreed agree_membership(Store& store, const std::string& base, const std::string& epoch, int rank, int size,
                        int64_t committed, const std::function<std::vector<Liveness>()>& answering, Deadline window,
                        Deadline dl) {
  store.set(base + "/in/" + std::to_string(rank), bytes(std::to_string(committed)), dl);
  const std::vector<int64_t> in = wait_check_ins(store, base, rank, size, answering, window, dl);
  const std::string view = claim_members(store, base + "/members", rank, in, reached(rank, answering), dl);
  Agreed a;
  for (const char* p = view.c_str(); *p;) {
    char* end = nullptr;
    const long r = std::strtol(p, &end, 10);
    const long long c = std::strtoll(end + 1, &end, 10);
    if (r == rank) a.me = static_cast<int>(a.members.size());
    a.members.push_back(static_cast<int>(r));
    a.committed.push_back(c);
    p = *end ? end + 1 : end;
  }
  if (a.me < 0) {
    std::string ranks;  // "0, 2" (the view itself is "rank:committed rank:committed ")
    for (int r : a.members) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    fail(DDP_ERR_RANK_LOST,
         "rank %d was left out of membership %s (the others agreed on ranks %s without it: it checked in too "
         "late, or it cannot reach them); its context is aborted: to take part again, join as a joiner would "
         "(ddp_comm_join_gloo)",
         rank, epoch.c_str(), ranks.c_str());
  }
  return a;
}

}  // namespace ddp
