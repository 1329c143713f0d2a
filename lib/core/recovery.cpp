// Elastic contexts (config.elastic): a lost peer ends the iteration with DDP_ERR_RANK_LOST instead of
// an abort, and ddp_recover goes on over the ranks that are left, in four steps: they agree on the
// new membership through the communicator's store (agree_members), make the next generation over it
// (Context::next_generation: new communicators, streams, and a reducer over the same registrations
// and the plan they agree on), confirm that every member made it, and learn whose state to take (the
// rank that committed the most iterations: a failed iteration may have completed on some ranks
// first). Joiners are admitted the same way (admission.cpp). docs/design.md, "Elastic membership".
#include <algorithm>

#include "core/context.hpp"
#include "core/log.hpp"

namespace ddp {

void Context::recover(ddp_membership_t* out, int* members, size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  if (health_.aborted)
    fail(DDP_ERR_ABORTED, "the context was aborted by an earlier error and can only be destroyed: %s",
         health_.abort_reason.c_str());
  if (!cfg_.c.elastic) fail(DDP_ERR_INVALID_STATE, "this context is not elastic (set config.elastic)");
  if (health_.joining) return join_job(out, members, capacity);
  if (!health_.lost && book_.joiners_waiting()) return admit_joiners(out, members, capacity);
  if (!health_.lost)
    fail(DDP_ERR_INVALID_STATE,
         "no rank was lost and none waits to join: ddp_recover follows a call that returned DDP_ERR_RANK_LOST or "
         "DDP_ERR_RANK_JOINING");
  // The old generation's work: cancelled; its collectives fail fast on the severed connections.
  const int64_t t = cfg_.c.timeout_ms;
  gen_->drain(Deadline::after_ms(t > 0 ? std::min<int64_t>(t, 10000) : 10000));
  // Ranks alive but late are waited for up to timeout_ms; the whole agreement ends within twice that.
  const Deadline dl = membership_deadline(t);
  const Generation* held = gen_.get();
  Regrouped g;
  try {
    try {
      g = agree_members(*gen_, book_.next_attempt(), static_cast<int64_t>(pass_.iterations), Deadline::after_ms(t), dl);
    } catch (const Error& e) {
      if (e.status() == DDP_ERR_RANK_LOST) abort(e);  // left out: this process is no longer in the job
      throw;
    }
    // The agreement may have spent most of the bound waiting for a rank that then died: the members
    // it agreed on are there now, and get at least timeout_ms to make the new communicators (a rank
    // left with a millisecond would give up on a creation the others complete).
    const Deadline made = Deadline::later(dl, Deadline::after_ms(t));
    confirm_members(*g.comm, made);
    next_generation(std::move(g.comm), made, &g.members);
    health_.lost = false;
    settle_membership(book_.held_rank, book_.held_world, book_.held_numbers, g.committed, out, members, capacity);
  } catch (const Error& e) {
    // The members of the membership this rank gives up on stop waiting for it (each goes on to the
    // next attempt at once, rather than at its own deadline, and finds the others there).
    if (gen_.get() != held)
      gen_->give_up();
    else if (g.comm)
      g.comm->give_up();
    // A member of the new world lost on the way (its connection closed, NCCL's creation failed for
    // it): one more change, which the next ddp_recover makes. Refusals and a rank left out stay.
    if (e.status() != DDP_ERR_ABORTED && e.status() != DDP_ERR_NCCL) throw;
    fail(DDP_ERR_TIMEOUT,
         "the new membership could not be formed (a rank was lost while it was being formed, or the store is "
         "gone); the context stays lost: call ddp_recover again: %s",
         e.what());
  }
}

// The current generation retires as the next one is swapped in (its communicators keep what a
// written-off worker may still use); the next one stands up over `comm`, with the reducer over the
// plan the members agree on.
void Context::next_generation(std::unique_ptr<Comm> comm, Deadline dl, const std::vector<int>* members) {
  if (gen_) {
    uint64_t wire[2];
    gen_->wire_totals(true, wire);
    wire_carried_[0] += wire[0];
    wire_carried_[1] += wire[1];
  }
  std::unique_ptr<Plan> plan(gen_ && gen_->reducer() ? new Plan(gen_->reducer()->plan()) : nullptr);
  Comm& over = *comm;
  std::unique_ptr<Generation> next(new Generation(over, std::move(comm)));
  if (members && gen_) next->keep_prober(*gen_, *members);
  // Each new rank's number in the membership last held, which the report of this change (or, should
  // this one fail to stand, of the next attempt's) gives.
  book_.held_numbers = book_.held_numbers_of(static_cast<size_t>(next->world()), world(), members);
  gen_ = std::move(next);
  {
    const CreationScope bounded(dl);
    gen_->stand_up(cfg_, stream_comms_, *device_, hooks());
  }
  plan = agreed_plan(ctrl(), plan.get(), regs_.specs, cfg_, &book_.admitted_upto, dl);
  book_.pending_upto = book_.admitted_upto;
  if (plan) {  // registration closed (rank 0 committed, so every rank's registrations matched)
    make_reducer(*plan);
    learner_.reset(regs_.specs.size());
    pass_.unused.reserve(regs_.specs.size());
    pass_.state = State::Idle;
  } else {
    pass_.state = State::Open;  // the next call that closes registration commits over the survivors
  }
  pass_.learning = false;
  pass_.user_stream = nullptr;
}

void Context::settle_membership(int old_rank, int old_world, std::vector<int> list,
                                const std::vector<int64_t>& committed, ddp_membership_t* out, int* members,
                                size_t capacity) {
  if (committed.empty()) {  // no change after all (every joiner was passed over, or failed to arrive)
    if (members)
      for (int i = 0; i < world() && static_cast<size_t>(i) < capacity; ++i) members[i] = i;
    if (out) {
      ddp_membership_t m{};
      m.epoch = book_.epoch;
      m.rank = m.old_rank = rank();
      m.world = m.old_world = world();
      m.committed = static_cast<int64_t>(pass_.iterations);
      *out = m;
    }
    return;
  }
  // Whose state every rank takes: the first of those that committed the most iterations.
  const int64_t most = *std::max_element(committed.begin(), committed.end());
  const int source = static_cast<int>(std::find(committed.begin(), committed.end(), most) - committed.begin());
  const bool behind = static_cast<int64_t>(pass_.iterations) < most || old_rank < 0;
  pass_.iterations = static_cast<uint64_t>(most);
  progress_.iteration.store(most, std::memory_order_relaxed);
  ++book_.epoch;
  book_.attempts = 0;
  book_.held_rank = rank(), book_.held_world = world();
  book_.held_numbers.clear();
  book_.held_desk = ctrl().join_desk();
  stragglers_.reset();
  std::string text;
  for (int m : list) text += (text.empty() ? "" : ", ") + (m < 0 ? std::string("joiner") : std::to_string(m));
  log(DDP_LOG_WARN, "libddp: membership %llu: rank %d of %d is now rank %d of %d (old ranks %s); state from rank %d%s",
      static_cast<unsigned long long>(book_.epoch), old_rank, old_world, rank(), world(), text.c_str(), source,
      behind ? " (this rank is behind)" : "");
  if (members)
    for (size_t i = 0; i < list.size() && i < capacity; ++i) members[i] = list[i];
  if (out) {
    ddp_membership_t m{};
    m.epoch = book_.epoch;
    m.rank = rank();
    m.world = world();
    m.old_rank = old_rank;
    m.old_world = old_world;
    m.source = source;
    m.behind = behind ? 1 : 0;
    m.committed = most;
    *out = m;
  }
}

Error Context::lose(const Error& e) {
  health_.lost = true;
  health_.lost_reason = format("rank %d of %d, iteration %llu (not committed: skip its update): %s", rank(), world(),
                               static_cast<unsigned long long>(pass_.iterations), e.what());
  // Every peer blocked on this rank fails now rather than at its timeout, and does the same.
  if (gen_) gen_->sever();
  if (timeline_) timeline_->flush();
  log(DDP_LOG_WARN, "libddp: %s", health_.lost_reason.c_str());
  return Error(DDP_ERR_RANK_LOST,
               "a rank was lost; call ddp_recover, then go on with the next iteration: " + health_.lost_reason);
}

// Counted under the membership last held (a failed recovery may have left the context over another).
// A second at most: the store may have gone with rank 0, and a member that cannot say it left only
// leaves the joiners to their own bound.
void Context::leave_job() {
  if (!book_.held_desk || health_.joining || health_.aborted || book_.held_rank < 0) return;
  try {
    book_.held_desk->leave(book_.held_rank, book_.held_world, Deadline::after_ms(1000));
  } catch (...) {
  }
}

}  // namespace ddp
