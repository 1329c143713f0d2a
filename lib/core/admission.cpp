// Elastic joins: a process started after the job (a replacement for a lost rank, or one more rank)
// asks through the job's store to be admitted; the ranks' join watches see the request (joins.hpp),
// the exchange that ends each synced iteration makes them agree on it, and the next iteration
// answers DDP_ERR_RANK_JOINING. ddp_recover then admits it: the ranks (admit_joiners) and the joiner
// (join_job) meet on a new communicator, and every one of them makes the next generation over it, as
// after a loss (recovery.cpp). docs/design.md, "Elastic membership".
#include <algorithm>
#include <cstdlib>

#include "core/context.hpp"
#include "core/log.hpp"

namespace ddp {

void Context::watch_joins() {
  gen_->watch_joins(book_.admitted_upto, join_terms(cfg_, ctrl().memory(), regs_.specs, static_cast<bool>(hook_)));
}

// The joiners the ranks agreed on: rank 0 reads their requests and passes over those refused or
// given up, every rank learns its choice, and all meet the joiners on a new communicator. Whether
// every rank made it is asked on the old one: where any did not (a joiner died on the way), every rank
// goes on as it was.
void Context::admit_joiners(ddp_membership_t* out, int* members, size_t capacity) {
  const Deadline dl = membership_deadline(cfg_.c.timeout_ms);
  const int64_t from = book_.admitted_upto, upto = book_.pending_upto;
  std::vector<int64_t> wire(static_cast<size_t>(upto - from) + 1, 0);
  std::shared_ptr<JoinDesk> desk = ctrl().join_desk();
  if (rank() == 0 && desk) {
    const JoinTerms terms = join_terms(cfg_, ctrl().memory(), regs_.specs, static_cast<bool>(hook_));
    JoinWatch* watch = gen_->join_watch();
    for (int64_t slot = from; slot < upto; ++slot) {
      std::string text;
      bool expired = false;
      if (!desk->request(slot, &text) || desk->answered(slot)) continue;
      const std::string why = refuse_join(text, terms, &expired);
      if (!why.empty()) desk->answer(slot, JoinAnswer::refused(why));
      // (a joiner whose heartbeat stopped is passed over: the others would wait for it in vain; told
      // so, in case it only stalled, it asks again)
      const bool stopped = !expired && watch && !watch->alive(slot);
      if (why.empty() && stopped) desk->answer(slot, JoinAnswer::passed_over());
      if (why.empty() && !expired && !stopped) wire[static_cast<size_t>(++wire[0])] = slot;
    }
  }
  std::vector<int64_t> slots;
  std::unique_ptr<Comm> comm;
  int32_t ok = 1;
  fatal_on_error([&] { ctrl().broadcast_host(wire.data(), wire.size() * sizeof(int64_t), 0, dl); });
  slots.assign(wire.begin() + 1, wire.begin() + 1 + wire[0]);
  book_.admitted_upto = book_.pending_upto = upto;
  if (slots.empty()) return settle_membership(rank(), world(), {}, {}, out, members, capacity);
  try {
    // A joiner is waiting when it is admitted: it arrives at once, or it died on its way in.
    const Deadline arrive = Deadline::earlier(dl, Deadline::after_ms(kJoinArriveMs));
    const CreationScope bounded(arrive);
    comm = ctrl().admit(book_.next_attempt(), slots, std::to_string(book_.epoch + 1), arrive);
  } catch (const Error& e) {
    ok = 0;
    log(DDP_LOG_WARN, "libddp: rank %d: the admission of %zu joiner(s) failed here: %s", rank(), slots.size(),
        e.what());
  }
  std::vector<int32_t> all(static_cast<size_t>(world()), 0);
  fatal_on_error([&] { ctrl().allgather_host(&ok, all.data(), sizeof ok, dl); });
  if (std::find(all.begin(), all.end(), 0) != all.end()) {
    comm.reset();
    log(DDP_LOG_WARN,
        "libddp: the joiners did not complete their admission (a joiner died or left): membership unchanged");
    return settle_membership(rank(), world(), {}, {}, out, members, capacity);
  }
  // A joiner lost from here on is a loss of the new membership (DDP_ERR_RANK_LOST; ddp_recover again).
  std::vector<int64_t> committed;
  fatal_on_error([&] {
    next_generation(std::move(comm), dl);
    committed.assign(static_cast<size_t>(world()), 0);
    const int64_t mine = static_cast<int64_t>(pass_.iterations);
    ctrl().allgather_host(&mine, committed.data(), sizeof mine, dl);
  });
  settle_membership(book_.held_rank, book_.held_world, book_.held_numbers, committed, out, members, capacity);
}

// A joiner: files its request, waits for the job's answer, and takes part in the rebuild that every
// rank of the job makes over the new membership (the plan is the job's). A failure leaves it a joiner
// that may ask again.
void Context::join_job(ddp_membership_t* out, int* members, size_t capacity) {
  if (regs_.specs.empty())
    fail(DDP_ERR_INVALID_STATE,
         "register the grads before ddp_recover: the job admits a joiner whose grads match its own");
  const Deadline dl = membership_deadline(cfg_.c.timeout_ms);
  JoinOutcome o;
  try {
    o = joiner_->join(join_terms(cfg_, joiner_->memory(), regs_.specs, static_cast<bool>(hook_)), Deadline::never());
  } catch (const Error& e) {
    // No answer in time: as it is. Anything else (the job gave up on this admission and closed what it
    // had made: another joiner of it never came) is one more try to make.
    if (e.status() == DDP_ERR_TIMEOUT) throw;
    fail(DDP_ERR_TIMEOUT, "the admission did not complete (call ddp_recover again to ask again): %s", e.what());
  }
  switch (o.answer.kind) {
    case JoinAnswer::Kind::Admitted: break;
    case JoinAnswer::Kind::Refused:
      fail(DDP_ERR_MISMATCH, "the running job at %s refused this process: %s", o.job.c_str(), o.answer.why.c_str());
    case JoinAnswer::Kind::JobEnded: {  // nothing left to join
      const Error e(DDP_ERR_ABORTED,
                    format("the job at %s ended before admitting this process (every rank of its last membership "
                           "destroyed its context): there is no job left to join; destroy this context",
                           o.job.c_str()));
      abort(e);
      throw e;
    }
    case JoinAnswer::Kind::PassedOver:
      fail(DDP_ERR_INTERNAL, "the joiner's communicator returned a passed-over answer (it asks again itself)");
  }
  std::unique_ptr<Comm> comm = std::move(o.comm);
  const std::string note = o.answer.note;
  std::unique_ptr<Comm> joiner = std::move(joiner_);
  try {
    health_.joining = false;
    next_generation(std::move(comm), dl);
    std::vector<int64_t> committed(static_cast<size_t>(world()), 0);
    const int64_t mine = -1;
    ctrl().allgather_host(&mine, committed.data(), sizeof mine, dl);
    std::vector<int> list(static_cast<size_t>(world()), -1);
    int before = 0;
    for (int r = 0; r < world(); ++r)
      if (committed[static_cast<size_t>(r)] >= 0) list[static_cast<size_t>(r)] = before++;
    book_.epoch = std::strtoull(note.c_str(), nullptr, 10) - 1;
    if (!cfg_.timeline_path.empty() && !timeline_)
      timeline_.reset(new Timeline(cfg_.timeline_path, rank(), cfg_.c.num_streams));
    settle_membership(-1, before, list, committed, out, members, capacity);
  } catch (const Error& e) {
    gen_.reset();
    joiner_ = std::move(joiner);
    health_.joining = true;
    book_.held_rank = -1;
    book_.held_world = 0;
    book_.held_numbers.clear();
    pass_.state = State::Open;
    fail(e.status() == DDP_ERR_MISMATCH ? DDP_ERR_MISMATCH : DDP_ERR_TIMEOUT,
         "the admission did not complete (call ddp_recover again to ask again): %s", e.what());
  }
}

}  // namespace ddp
