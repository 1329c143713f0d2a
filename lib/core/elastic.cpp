// Elastic contexts (config.elastic): a lost peer ends the iteration with DDP_ERR_RANK_LOST instead of
// an abort, and ddp_recover rebuilds the context over the ranks that are left: they agree on the new
// membership through the communicator's store (Comm::regroup), get new communicators, streams and
// a new reducer over the same registrations and plan, and learn whose state to take (the rank that
// committed the most iterations: a failed iteration may have completed on some ranks first).
#include <algorithm>

#include "core/context.hpp"
#include "core/log.hpp"

namespace ddp {

Error Context::lose(const Error& e) {
  lost_ = true;
  lost_reason_ = format("rank %d of %d, iteration %llu (not committed: skip its update): %s", rank_, world_,
                        static_cast<unsigned long long>(iterations_), e.what());
  if (reducer_) reducer_->cancel();
  // Every peer blocked on this rank fails now rather than at its timeout, and does the same.
  for (Comm* c : comms_) c->sever();
  ctrl_->sever();
  if (bcast_) bcast_->sever();
  if (timeline_) timeline_->flush();
  log(DDP_LOG_WARN, "libddp: %s", lost_reason_.c_str());
  return Error(DDP_ERR_RANK_LOST,
               "a rank was lost; call ddp_recover, then go on with the next iteration: " + lost_reason_);
}

// The plan every survivor goes on with: the new rank 0's (none: every rank commits again). A failed
// first iteration may have left some ranks with the learned plan and others without, and a loss in
// ddp_commit some ranks committed and others not; each would then run different collectives.
std::unique_ptr<Plan> Context::agreed_plan(const Plan* mine, Deadline dl) {
  std::vector<int64_t> wire(2 + 2 * specs_.size(), 0);
  if (rank_ == 0 && mine) {
    wire[0] = mine->learned ? 2 : 1;
    if (mine->learned) {
      const std::vector<int64_t> s = mine->serialize();
      std::copy(s.begin(), s.end(), wire.begin() + 1);
    }
  }
  ctrl_->broadcast_host(wire.data(), wire.size() * sizeof(int64_t), 0, dl);
  if (wire[0] == 0) return nullptr;
  if (wire[0] == 1)
    return std::unique_ptr<Plan>(new Plan(registration_plan(specs_, cfg_.c.message_size, cfg_.c.num_streams)));
  return std::unique_ptr<Plan>(
      new Plan(Plan::deserialize(wire.data() + 1, wire.size() - 1, specs_, cfg_.c.num_streams)));
}

void Context::recover(ddp_membership_t* out, int* members, size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_)
    fail(DDP_ERR_ABORTED, "the context was aborted by an earlier error and can only be destroyed: %s",
         abort_reason_.c_str());
  if (!cfg_.c.elastic) fail(DDP_ERR_INVALID_STATE, "this context is not elastic (set config.elastic)");
  if (!lost_)
    fail(DDP_ERR_INVALID_STATE, "no rank was lost: ddp_recover follows a call that returned DDP_ERR_RANK_LOST");
  // The old generation's work: cancelled; its collectives fail fast on the severed connections.
  const int64_t t = cfg_.c.timeout_ms;
  for (auto& s : streams_) {
    try {
      s->drain(Deadline::after_ms(t > 0 ? std::min<int64_t>(t, 10000) : 10000));
    } catch (...) {  // a failed or written-off task: the failure is known already
    }
  }
  // Ranks alive but late are waited for up to timeout_ms; the whole agreement ends within twice that.
  const Deadline dl = Deadline::after_ms(t > 0 && t < INT64_MAX / 2 ? 2 * t : t);
  const int old_rank = rank_, old_world = world_;
  Regrouped g = agree_members(Deadline::after_ms(t), dl);
  rebuild(std::move(g.comm), dl);
  // Whose state every rank takes: the first of those that committed the most iterations.
  const int64_t most = *std::max_element(g.committed.begin(), g.committed.end());
  const int source = static_cast<int>(std::find(g.committed.begin(), g.committed.end(), most) - g.committed.begin());
  const bool behind = static_cast<int64_t>(iterations_) < most;
  iterations_ = static_cast<uint64_t>(most);
  progress_.iteration.store(most, std::memory_order_relaxed);
  ++epoch_;
  attempts_ = 0;
  stragglers_.reset();
  lost_ = false;
  std::string list;
  for (int m : g.members) list += (list.empty() ? "" : ", ") + std::to_string(m);
  log(DDP_LOG_WARN, "libddp: membership %llu: rank %d of %d is now rank %d of %d (old ranks %s); state from rank %d%s",
      static_cast<unsigned long long>(epoch_), old_rank, old_world, rank_, world_, list.c_str(), source,
      behind ? " (this rank is behind)" : "");
  if (members)
    for (size_t i = 0; i < g.members.size() && i < capacity; ++i) members[i] = g.members[i];
  if (out) {
    ddp_membership_t m{};
    m.epoch = epoch_;
    m.rank = rank_;
    m.world = world_;
    m.old_rank = old_rank;
    m.old_world = old_world;
    m.source = source;
    m.behind = behind ? 1 : 0;
    m.committed = most;
    *out = m;
  }
}

// Check in with the others through the store; whether a rank that has not checked in is still alive
// is asked through the stall inspector's ports (a dead process refuses at once).
Regrouped Context::agree_members(Deadline window, Deadline dl) {
  Prober* prober = prober_.get();
  const int old_world = world_;
  auto answering = [prober, old_world] {
    std::vector<bool> alive(static_cast<size_t>(old_world), true);
    if (!prober) return alive;
    const std::vector<Position> pos = prober->ask(300);
    for (size_t r = 0; r < alive.size() && r < pos.size(); ++r) alive[r] = pos[r].iteration >= 0;
    return alive;
  };
  try {
    // A failed attempt (a survivor died during it) is retried under a name of its own.
    const std::string name = std::to_string(epoch_ + 1) + "." + std::to_string(attempts_++);
    return ctrl_->regroup(name, static_cast<int64_t>(iterations_), answering, window, dl);
  } catch (const Error& e) {
    if (e.status() == DDP_ERR_RANK_LOST) abort(e);  // left out: this process is no longer in the job
    throw;
  }
}

// The old generation retired (its communicators keep what a written-off worker may still use), the
// new one made over `comm`, with the reducer over the plan the survivors agree on.
void Context::rebuild(std::unique_ptr<Comm> comm, Deadline dl) {
  uint64_t wire[2];
  wire_totals(true, wire);
  wire_carried_[0] = wire[0] + wire_base_[0];
  wire_carried_[1] = wire[1] + wire_base_[1];
  std::unique_ptr<Plan> plan(reducer_ ? new Plan(reducer_->plan()) : nullptr);
  reducer_.reset();
  streams_.clear();
  prober_.reset();
  owned_comms_.clear();
  comms_.clear();
  bcast_.reset();
  ctrl_.reset();
  base_ = std::move(comm);
  {
    const CreationScope bounded(dl);
    ctrl_ = base_->dup();
    attach(*base_);
  }
  plan = agreed_plan(plan.get(), dl);
  if (plan) {  // registration closed (rank 0 committed, so every rank's registrations matched)
    make_reducer(*plan);
    learner_.reset(specs_.size());
    scratch_unused_.reserve(specs_.size());
    state_ = State::Idle;
  } else {
    state_ = State::Open;  // the next call that closes registration commits over the survivors
  }
  learning_ = false;
  user_stream_ = nullptr;
}

}  // namespace ddp
