// A Gloo communicator's elastic membership changes: the survivors' agreement on the next membership
// and its communicator (regroup), the job's admission of joiners (admit). docs/design.md, "Elastic
// membership"; the context's side is lib/core/recovery.cpp and admission.cpp.
#include "backends/gloo/gloo_comm.hpp"
#include "backends/gloo/gloo_mesh.hpp"
#include "host/marked_store.hpp"
#include "host/membership.hpp"

namespace ddp {

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
    if (e.status() != DDP_ERR_RANK_LOST)
      MarkedStore::mark(*world_->rv.store, base + "/abandoned", "old rank " + std::to_string(rank()));
    throw;
  }
  Regrouped g;
  g.members = a.members;
  g.committed = a.committed;
  g.comm.reset(
      new GlooComm(world_, base + ".c", dl, a.me, static_cast<int>(a.members.size()), lineage_, base + "/abandoned"));
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

}  // namespace ddp
