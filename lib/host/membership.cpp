#include "host/membership.hpp"

#include <chrono>
#include <cstdlib>
#include <thread>

namespace ddp {

namespace {

std::vector<char> bytes(const std::string& t) { return std::vector<char>(t.begin(), t.end()); }

// The check-ins: in[r] is the iterations rank r committed, -1 while it has not checked in. Returns
// when every rank checked in or was silent for two asks in a row, or at `window`.
std::vector<int64_t> wait_check_ins(Store& store, const std::string& base, int rank, int n,
                                    const std::function<std::vector<bool>()>& answering, Deadline window, Deadline dl) {
  std::vector<int64_t> in(static_cast<size_t>(n), -1);
  std::vector<int> silent(static_cast<size_t>(n), 0);  // asks in a row without an answer
  uint64_t next_ask = 0;
  for (;;) {
    int waiting = 0;
    for (size_t r = 0; r < in.size(); ++r) {
      std::vector<char> v;
      if (in[r] < 0 && store.try_get(base + "/in/" + std::to_string(r), &v, dl))
        in[r] = std::atoll(std::string(v.begin(), v.end()).c_str());
      if (in[r] < 0 && silent[r] < 2) ++waiting;
    }
    if (waiting == 0 || window.passed()) return in;
    if (dl.passed()) fail(DDP_ERR_TIMEOUT, "rank %d: the ranks did not agree on a membership in time", rank);
    const uint64_t now = now_ns();
    if (now >= next_ask) {
      const std::vector<bool> alive = answering();
      for (size_t r = 0; r < silent.size(); ++r) silent[r] = alive[r] ? 0 : silent[r] + 1;
      next_ask = now_ns() + 100 * 1000000ull;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

// Of the ranks that checked in, those this rank reaches now (asked twice for a rank silent once): a
// rank cut off from this one may still have reached the store (a shared file system) and checked in.
std::vector<bool> reached(const std::vector<int64_t>& in, int rank,
                          const std::function<std::vector<bool>()>& answering) {
  std::vector<bool> ok = answering();
  bool all = true;
  for (size_t r = 0; r < in.size(); ++r) all = all && (in[r] < 0 || ok[r] || static_cast<int>(r) == rank);
  if (!all) {
    const std::vector<bool> again = answering();
    for (size_t r = 0; r < ok.size(); ++r) ok[r] = ok[r] || again[r];
  }
  ok[static_cast<size_t>(rank)] = true;
  return ok;
}

// Proposes the ranks that checked in and are reached ("rank:committed ..."), or, on the smaller side
// of a cut (or an even split), waits for the other side's proposal; returns the one the store kept.
std::string claim_members(Store& store, const std::string& key, int rank, const std::vector<int64_t>& in,
                          const std::vector<bool>& reach, Deadline dl) {
  std::string view;
  int checked = 0, seen = 0;
  for (size_t r = 0; r < in.size(); ++r) {
    if (in[r] < 0) continue;
    ++checked;
    if (!reach[r]) continue;
    ++seen;
    view += std::to_string(r) + ":" + std::to_string(in[r]) + " ";
  }
  std::vector<char> held;
  if (2 * seen > checked) {
    if (!store.claim(key, bytes(view), &held, dl)) view.assign(held.begin(), held.end());
    return view;
  }
  try {
    held = store.get(key, dl, "a membership from the ranks this one cannot reach");
  } catch (const Error& e) {
    if (e.status() != DDP_ERR_TIMEOUT) throw;
    fail(DDP_ERR_TIMEOUT,
         "rank %d reaches %d of the %d ranks that checked in (the network is split, or they stall): no side holds "
         "a majority, and no membership was agreed before the deadline",
         rank, seen, checked);
  }
  return std::string(held.begin(), held.end());
}

}  // namespace

Agreed agree_membership(Store& store, const std::string& base, const std::string& epoch, int rank, int size,
                        int64_t committed, const std::function<std::vector<bool>()>& answering, Deadline window,
                        Deadline dl) {
  store.set(base + "/in/" + std::to_string(rank), bytes(std::to_string(committed)), dl);
  const std::vector<int64_t> in = wait_check_ins(store, base, rank, size, answering, window, dl);
  const std::string view = claim_members(store, base + "/members", rank, in, reached(in, rank, answering), dl);
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
  if (a.me < 0)
    fail(DDP_ERR_RANK_LOST,
         "rank %d was left out of membership %s (the others agreed on ranks %s without it: it checked in too "
         "late, or it cannot reach them); its context is aborted: to take part again, join as a joiner would "
         "(ddp_comm_join_gloo)",
         rank, epoch.c_str(), view.c_str());
  return a;
}

}  // namespace ddp
