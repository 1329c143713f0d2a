// Elastic contexts (config.elastic): a lost peer ends the iteration with DDP_ERR_RANK_LOST instead of
// an abort, and ddp_recover rebuilds the context over the ranks that are left: they agree on the new
// membership through the communicator's store (Comm::regroup), get new communicators, streams and
// a new reducer over the same registrations and plan, and learn whose state to take (the rank that
// committed the most iterations: a failed iteration may have completed on some ranks first).
// Joins go the same way: a joiner's request, seen by the ranks' join watches and agreed in an
// iteration's exchange, makes the next iteration answer DDP_ERR_RANK_JOINING; ddp_recover then admits
// it (Comm::admit on the ranks, Comm::join on the joiner) and rebuilds the context over everyone.
#include <algorithm>
#include <cstdlib>
#include <cstring>

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
  if (ctrl_) ctrl_->sever();
  if (bcast_) bcast_->sever();
  if (timeline_) timeline_->flush();
  log(DDP_LOG_WARN, "libddp: %s", lost_reason_.c_str());
  return Error(DDP_ERR_RANK_LOST,
               "a rank was lost; call ddp_recover, then go on with the next iteration: " + lost_reason_);
}

// The plan every survivor goes on with: the new rank 0's (none: every rank commits again). A failed
// first iteration may have left some ranks with the learned plan and others without, and a loss in
// ddp_commit some ranks committed and others not; each would then run different collectives. The
// join slots settled travel with it (a loss in the middle of an admission leaves ranks apart), and
// the agreed joiners still waiting are forgotten: the watches see them again and the next exchange
// agrees on them anew.
std::unique_ptr<Plan> Context::agreed_plan(const Plan* mine, Deadline dl) {
  std::vector<int64_t> wire(3 + 2 * specs_.size(), 0);
  if (rank_ == 0) {
    wire.back() = admitted_upto_;
    if (mine) {
      wire[0] = mine->learned ? 2 : 1;
      if (mine->learned) {
        const std::vector<int64_t> s = mine->serialize();
        std::copy(s.begin(), s.end(), wire.begin() + 1);
      }
    }
  }
  ctrl_->broadcast_host(wire.data(), wire.size() * sizeof(int64_t), 0, dl);
  admitted_upto_ = pending_upto_ = wire.back();
  wire.pop_back();
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
  if (joining_) return join_job(out, members, capacity);
  if (!lost_ && pending_upto_ > admitted_upto_) return admit_joiners(out, members, capacity);
  if (!lost_)
    fail(DDP_ERR_INVALID_STATE,
         "no rank was lost and none waits to join: ddp_recover follows a call that returned DDP_ERR_RANK_LOST or "
         "DDP_ERR_RANK_JOINING");
  // The old generation's work: cancelled; its collectives fail fast on the severed connections.
  const int64_t t = cfg_.c.timeout_ms;
  for (auto& s : streams_) {
    try {
      s->drain(Deadline::after_ms(t > 0 ? std::min<int64_t>(t, 10000) : 10000));
    } catch (...) {  // a failed or written-off task: the failure is known already
    }
  }
  // Ranks alive but late are waited for up to timeout_ms; the whole agreement ends within twice that.
  const Deadline dl = membership_deadline();
  try {
    Regrouped g = agree_members(Deadline::after_ms(t), dl);
    // The agreement may have spent most of the bound waiting for a rank that then died: the members
    // it agreed on are there now, and get at least timeout_ms to make the new communicators (a rank
    // left with a millisecond would give up on a creation the others complete).
    const Deadline made = Deadline::later(dl, Deadline::after_ms(t));
    confirm_members(*g.comm, made);
    rebuild(std::move(g.comm), made, &g.members);
    lost_ = false;
    settle_membership(held_rank_, held_world_, held_numbers_, g.committed, out, members, capacity);
  } catch (const Error& e) {
    // A member of the new world lost on the way (its connection closed, NCCL's creation failed for
    // it): one more change, which the next ddp_recover makes. Refusals and a rank left out stay.
    if (e.status() != DDP_ERR_ABORTED && e.status() != DDP_ERR_NCCL) throw;
    fail(DDP_ERR_TIMEOUT,
         "the new membership could not be formed (a rank was lost while it was being formed, or the store is "
         "gone); the context stays lost: call ddp_recover again: %s",
         e.what());
  }
}

void Context::settle_membership(int old_rank, int old_world, std::vector<int> list,
                                const std::vector<int64_t>& committed, ddp_membership_t* out, int* members,
                                size_t capacity) {
  if (committed.empty()) {  // no change after all (every joiner was passed over, or failed to arrive)
    if (members)
      for (int i = 0; i < world_ && static_cast<size_t>(i) < capacity; ++i) members[i] = i;
    if (out) {
      ddp_membership_t m{};
      m.epoch = epoch_;
      m.rank = m.old_rank = rank_;
      m.world = m.old_world = world_;
      m.committed = static_cast<int64_t>(iterations_);
      *out = m;
    }
    return;
  }
  // Whose state every rank takes: the first of those that committed the most iterations.
  const int64_t most = *std::max_element(committed.begin(), committed.end());
  const int source = static_cast<int>(std::find(committed.begin(), committed.end(), most) - committed.begin());
  const bool behind = static_cast<int64_t>(iterations_) < most || old_rank < 0;
  iterations_ = static_cast<uint64_t>(most);
  progress_.iteration.store(most, std::memory_order_relaxed);
  ++epoch_;
  attempts_ = 0;
  held_rank_ = rank_, held_world_ = world_;
  held_numbers_.clear();
  held_desk_ = ctrl_->join_desk();
  stragglers_.reset();
  std::string text;
  for (int m : list) text += (text.empty() ? "" : ", ") + (m < 0 ? std::string("joiner") : std::to_string(m));
  log(DDP_LOG_WARN, "libddp: membership %llu: rank %d of %d is now rank %d of %d (old ranks %s); state from rank %d%s",
      static_cast<unsigned long long>(epoch_), old_rank, old_world, rank_, world_, text.c_str(), source,
      behind ? " (this rank is behind)" : "");
  if (members)
    for (size_t i = 0; i < list.size() && i < capacity; ++i) members[i] = list[i];
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
  // (after a rebuild or an admission that failed half way, the new membership's communicator is all
  // there is; the prober kept from before asks its members by their old numbers)
  Comm& at = ctrl_ ? *ctrl_ : *base_;
  Prober* prober = prober_.get();
  const int n = at.size();
  const std::vector<int> numbers = probe_numbers_;
  auto answering = [prober, n, numbers] {
    std::vector<Liveness> alive(static_cast<size_t>(n), Liveness::Alive);
    if (!prober) return alive;
    // A live rank answers from its inspector thread within milliseconds; a cut-off one never does,
    // and each ask for it costs the whole wait.
    const std::vector<Position> pos = prober->ask(150);
    for (size_t r = 0; r < alive.size(); ++r) {
      const size_t p = numbers.empty() ? r : static_cast<size_t>(numbers[r]);
      if (p < pos.size()) alive[r] = liveness_of(pos[p]);
    }
    return alive;
  };
  try {
    // A failed attempt (a survivor died during it) is retried under a name of its own.
    const std::string name = std::to_string(epoch_ + 1) + "." + std::to_string(attempts_++);
    return at.regroup(name, static_cast<int64_t>(iterations_), answering, window, dl);
  } catch (const Error& e) {
    if (e.status() == DDP_ERR_RANK_LOST) abort(e);  // left out: this process is no longer in the job
    throw;
  }
}

// Every member of the membership just agreed on made its communicator: one exchange over it. A member
// lost while the communicators were being made (some ranks made theirs, others timed out waiting for
// it) fails it on every rank, so that all of them try again from the membership they had, never some
// from the old one and some from the new.
void Context::confirm_members(Comm& made, Deadline dl) {
  const int32_t one = 1;
  std::vector<int32_t> all(static_cast<size_t>(made.size()), 0);
  made.allgather_host(&one, all.data(), sizeof one, dl);
}

// What a membership change may take: twice timeout_ms (the live but late are waited for up to
// timeout_ms, then the agreement and the rebuild have as much again).
Deadline Context::membership_deadline() const {
  const int64_t t = cfg_.c.timeout_ms;
  return Deadline::after_ms(t > 0 && t < INT64_MAX / 2 ? 2 * t : t);
}

// Counted under the membership last held (a failed recovery may have left ctrl_ over another). A
// second at most: the store may have gone with rank 0, and a member that cannot say it left only
// leaves the joiners to their own bound.
void Context::leave_job() {
  if (!held_desk_ || joining_ || aborted_ || held_rank_ < 0) return;
  try {
    held_desk_->leave(held_rank_, held_world_, Deadline::after_ms(1000));
  } catch (...) {
  }
}

void Context::retire() {
  join_watch_.reset();
  reducer_.reset();
  streams_.clear();
  prober_.reset();
  owned_comms_.clear();
  comms_.clear();
  bcast_.reset();
  ctrl_.reset();
}

// The old generation retired (its communicators keep what a written-off worker may still use), the
// new one made over `comm`, with the reducer over the plan the survivors agree on.
void Context::rebuild(std::unique_ptr<Comm> comm, Deadline dl, const std::vector<int>* members) {
  uint64_t wire[2];
  wire_totals(true, wire);
  wire_carried_[0] = wire[0] + wire_base_[0];
  wire_carried_[1] = wire[1] + wire_base_[1];
  std::unique_ptr<Plan> plan(reducer_ ? new Plan(reducer_->plan()) : nullptr);
  // Until the new generation stands (attach makes its prober), the old prober stays: should this
  // rebuild fail (a member lost while it is made), the next agreement, over `comm`, still tells a
  // dead member from a late one by asking each by its old number.
  std::unique_ptr<Prober> kept;
  std::vector<int> numbers;
  if (members && prober_) {
    kept = std::move(prober_);
    for (int m : *members) numbers.push_back(probe_numbers_.empty() ? m : probe_numbers_[static_cast<size_t>(m)]);
  }
  // Each new rank's number in the membership last held, which the report of this change (or, should
  // this rebuild fail, of the next attempt's) gives.
  std::vector<int> held(static_cast<size_t>(comm->size()), -1);
  for (size_t i = 0; i < held.size(); ++i) {
    const int was = members ? (*members)[i] : static_cast<int>(i) < world_ ? static_cast<int>(i) : -1;
    if (was >= 0) held[i] = held_numbers_.empty() ? was : held_numbers_[static_cast<size_t>(was)];
  }
  retire();
  prober_ = std::move(kept);
  probe_numbers_ = std::move(numbers);
  held_numbers_ = std::move(held);
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

namespace ddp {

void Context::note_joins(int64_t upto) {
  if (upto > admitted_upto_) pending_upto_ = std::max(pending_upto_, upto);
}

void Context::watch_joins() {
  join_watch_.reset();
  std::shared_ptr<JoinDesk> desk = ctrl_->join_desk();
  if (desk)
    join_watch_.reset(new JoinWatch(std::move(desk), admitted_upto_,
                                    join_terms(cfg_, ctrl_->memory(), specs_, static_cast<bool>(hook_))));
}

// The joiners the ranks agreed on: rank 0 reads their requests and passes over those refused or
// given up, every rank learns its choice, and all meet the joiners on a new communicator. Whether
// every rank made it is asked on the old one: where any did not (a joiner died on the way), every rank
// goes on as it was.
void Context::admit_joiners(ddp_membership_t* out, int* members, size_t capacity) {
  const Deadline dl = membership_deadline();
  const int64_t from = admitted_upto_, upto = pending_upto_;
  std::vector<int64_t> wire(static_cast<size_t>(upto - from) + 1, 0);
  std::shared_ptr<JoinDesk> desk = ctrl_->join_desk();
  if (rank_ == 0 && desk) {
    const JoinTerms terms = join_terms(cfg_, ctrl_->memory(), specs_, static_cast<bool>(hook_));
    for (int64_t slot = from; slot < upto; ++slot) {
      std::string text;
      bool expired = false;
      if (!desk->request(slot, &text) || desk->answered(slot)) continue;
      const std::string why = refuse_join(text, terms, &expired);
      if (!why.empty()) desk->answer(slot, "R" + why);
      // (a joiner whose heartbeat stopped is passed over: the others would wait for it in vain; told
      // so, in case it only stalled, it asks again)
      const bool stopped = !expired && join_watch_ && !join_watch_->alive(slot);
      if (why.empty() && stopped) desk->answer(slot, "S");
      if (why.empty() && !expired && !stopped) wire[static_cast<size_t>(++wire[0])] = slot;
    }
  }
  std::vector<int64_t> slots;
  std::unique_ptr<Comm> comm;
  int32_t ok = 1;
  fatal_on_error([&] { ctrl_->broadcast_host(wire.data(), wire.size() * sizeof(int64_t), 0, dl); });
  slots.assign(wire.begin() + 1, wire.begin() + 1 + wire[0]);
  admitted_upto_ = pending_upto_ = upto;
  if (slots.empty()) return settle_membership(rank_, world_, {}, {}, out, members, capacity);
  try {
    // A joiner is waiting when it is admitted: ten seconds are plenty for it to arrive.
    const Deadline arrive = Deadline::earlier(dl, Deadline::after_ms(10000));
    const CreationScope bounded(arrive);
    comm = ctrl_->admit(std::to_string(epoch_ + 1) + "." + std::to_string(attempts_++), slots,
                        std::to_string(epoch_ + 1), arrive);
  } catch (const Error& e) {
    ok = 0;
    log(DDP_LOG_WARN, "libddp: rank %d: the admission of %zu joiner(s) failed here: %s", rank_, slots.size(), e.what());
  }
  std::vector<int32_t> all(static_cast<size_t>(world_), 0);
  fatal_on_error([&] { ctrl_->allgather_host(&ok, all.data(), sizeof ok, dl); });
  if (std::find(all.begin(), all.end(), 0) != all.end()) {
    comm.reset();
    log(DDP_LOG_WARN,
        "libddp: the joiners did not complete their admission (a joiner died or left): membership unchanged");
    return settle_membership(rank_, world_, {}, {}, out, members, capacity);
  }
  // A joiner lost from here on is a loss of the new membership (DDP_ERR_RANK_LOST; ddp_recover again).
  std::vector<int64_t> committed;
  fatal_on_error([&] {
    rebuild(std::move(comm), dl);
    committed.assign(static_cast<size_t>(world_), 0);
    const int64_t mine = static_cast<int64_t>(iterations_);
    ctrl_->allgather_host(&mine, committed.data(), sizeof mine, dl);
  });
  settle_membership(held_rank_, held_world_, held_numbers_, committed, out, members, capacity);
}

// A joiner: files its request, waits for the job's answer, and takes part in the rebuild that every
// rank of the job makes over the new membership (the plan is the job's). A failure leaves it a joiner
// that may ask again.
void Context::join_job(ddp_membership_t* out, int* members, size_t capacity) {
  if (specs_.empty())
    fail(DDP_ERR_INVALID_STATE,
         "register the grads before ddp_recover: the job admits a joiner whose grads match its own");
  const Deadline dl = membership_deadline();
  std::string note;
  std::unique_ptr<Comm> comm;
  try {
    comm = base_->join(join_request(join_terms(cfg_, base_->memory(), specs_, static_cast<bool>(hook_))), &note,
                       Deadline::never());
  } catch (const Error& e) {
    // Refused, or no answer in time: as it is. Anything else (the job gave up on this admission and
    // closed what it had made: another joiner of it never came) is one more try to make.
    const bool refused = std::strstr(e.what(), "refused this process") != nullptr;
    if (e.status() == DDP_ERR_TIMEOUT || refused) throw;
    if (std::strstr(e.what(), "ended before admitting") != nullptr) {  // nothing left to join
      abort(e);
      throw;
    }
    fail(DDP_ERR_TIMEOUT, "the admission did not complete (call ddp_recover again to ask again): %s", e.what());
  }
  std::unique_ptr<Comm> joiner = std::move(base_);
  try {
    joining_ = false;
    rebuild(std::move(comm), dl);
    std::vector<int64_t> committed(static_cast<size_t>(world_), 0);
    const int64_t mine = -1;
    ctrl_->allgather_host(&mine, committed.data(), sizeof mine, dl);
    std::vector<int> list(static_cast<size_t>(world_), -1);
    int before = 0;
    for (int r = 0; r < world_; ++r)
      if (committed[static_cast<size_t>(r)] >= 0) list[static_cast<size_t>(r)] = before++;
    epoch_ = std::strtoull(note.c_str(), nullptr, 10) - 1;
    if (!cfg_.timeline_path.empty() && !timeline_)
      timeline_.reset(new Timeline(cfg_.timeline_path, rank_, cfg_.c.num_streams));
    settle_membership(-1, before, list, committed, out, members, capacity);
  } catch (const Error& e) {
    retire();
    base_ = std::move(joiner);
    joining_ = true;
    rank_ = held_rank_ = -1;
    world_ = held_world_ = 0;
    held_numbers_.clear();
    state_ = State::Open;
    fail(e.status() == DDP_ERR_MISMATCH ? DDP_ERR_MISMATCH : DDP_ERR_TIMEOUT,
         "the admission did not complete (call ddp_recover again to ask again): %s", e.what());
  }
}

}  // namespace ddp
