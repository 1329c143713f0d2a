// The backward pass of the context: begin, the hook, finish (with the learned plan's first pass and
// the unused-grad policy), sync on/off, and apex's reduce-all.
#include <algorithm>

#include "core/context.hpp"
#include "core/log.hpp"

namespace ddp {

// Elastic: joiners the ranks agreed on wait; the iteration that would start now is the step boundary.
static void check_no_joiners(int64_t pending, int64_t admitted) {
  if (pending > admitted)
    fail(DDP_ERR_RANK_JOINING,
         "a process asked to join the job and waits at this step boundary (nothing of this call was done): call "
         "ddp_recover, take the state of membership.source (parameters, optimizer state, step count: the joiners "
         "receive it), then make this call again");
}

void Context::begin_backward(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (pass_.state == State::InBackward)
    fail(DDP_ERR_INVALID_STATE, "a backward pass is already in progress (call ddp_finish_backward first)");
  check_no_joiners(book_.pending_upto, book_.admitted_upto);
  fatal_on_error([&] {
    commit_locked();
    if (pass_.sync && cfg_.c.uneven_inputs != DDP_UNEVEN_OFF) vote(kBackwardPass);  // who contributes (ddp_join)
  });
  pass_.synced = pass_.sync;
  pass_.learning = pass_.sync && cfg_.learned() && !reducer().plan().learned;
  if (pass_.learning) learner_.reset(regs_.specs.size());
  reducer().begin(stream, pass_.iterations);
  pass_.user_stream = stream;
  pass_.begin_ns = now_ns();
  pass_.last_exposed_ns = 0;
  pass_.state = State::InBackward;
  progress_.iteration.store(static_cast<int64_t>(pass_.iterations), std::memory_order_relaxed);
  set_call(Call::Backward);
}

void Context::grad_ready(int index, void* grad) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (pass_.state != State::InBackward)
    fail(DDP_ERR_INVALID_STATE, "grad %d: no backward pass in progress (call ddp_begin_backward first)", index);
  check_index(index);
  if (reducer().is_ready(index))
    fail(DDP_ERR_INVALID_STATE, "grad %d was already marked ready in this backward pass", index);
  if (grad) {
    if (cfg_.arena()) fail(DDP_ERR_INVALID_STATE, "in the arena layout the library owns grad storage");
    check_grad_aligned(grad, regs_.specs[static_cast<size_t>(index)].dtype, index);
    if (grad != regs_.user_ptrs[static_cast<size_t>(index)]) {
      regs_.user_ptrs[static_cast<size_t>(index)] = grad;
      reducer().set_grad_ptr(index, grad);
    }
  }
  const uint64_t t = now_ns();
  pass_.last_ready_ns = t;
  if (timeline_) timeline_->grad_ready(index, t);
  if (pass_.learning) learner_.record(index);
  const bool launch = pass_.synced && !pass_.learning && cfg_.c.delay_allreduce == 0;
  fatal_on_error([&] { reducer().mark_ready(index, launch, t); });
}

// A bucket launched in this iteration can be waited for alone. One that is not launched yet waits
// for grads (its own or an earlier bucket's) that only this thread can mark, or for ddp_finish_backward
// (the first iteration of a learned plan, delay_allreduce, sync off): waiting would never end, so the
// answer is "not yet". Sharded buckets end as shards: ddp_get_shard after ddp_finish_backward.
bool Context::wait_grad(int index, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (pass_.state != State::InBackward)
    fail(DDP_ERR_INVALID_STATE,
         "grad %d: no backward pass in progress (ddp_wait_grad is for inside one; after ddp_finish_backward every "
         "grad is reduced)",
         index);
  check_index(index);
  if (!reducer().is_ready(index))
    fail(DDP_ERR_INVALID_STATE, "grad %d was not marked ready in this backward pass (call ddp_grad_ready first)",
         index);
  if (!pass_.synced || cfg_.sharded() || !reducer().launched_grad(index)) return false;
  CallScope scope(this, Call::WaitGrad);
  const uint64_t t0 = now_ns();
  fatal_on_error([&] { reducer().wait_grad(index, stream, Deadline::never()); });
  pass_.last_exposed_ns += now_ns() - t0;
  pass_.exposed_ns += now_ns() - t0;
  return true;
}

void Context::learn_plan() {
  // apex sync_bucket_structure: rank 0's learned buckets become every rank's.
  Plan local = learner_.finish(regs_.specs, cfg_.c.message_size, cfg_.c.num_streams);
  std::vector<int64_t> wire(1 + 2 * regs_.specs.size(), 0);
  if (rank() == 0) {
    std::vector<int64_t> s = local.serialize();
    std::copy(s.begin(), s.end(), wire.begin());
  }
  ctrl().broadcast_host(wire.data(), wire.size() * sizeof(int64_t), 0, deadline());
  Plan adopted = Plan::deserialize(wire.data(), wire.size(), regs_.specs, cfg_.c.num_streams);
  std::vector<int> unready;
  reducer().unready_grads(&unready);
  reducer().adopt(std::move(adopted), regs_.user_ptrs);
  log_plan();  // DDP_DEBUG=INFO: the plan every later iteration uses
  if (cfg_.arena()) ++pass_.layout_epoch;
  reducer().begin(pass_.user_stream, pass_.iterations);
  std::vector<char> skip(regs_.specs.size(), 0);
  for (int g : unready) skip[static_cast<size_t>(g)] = 1;
  const uint64_t t = now_ns();
  for (size_t g = 0; g < regs_.specs.size(); ++g)
    if (!skip[g]) reducer().mark_ready(static_cast<int>(g), false, t);
}

void Context::wait_buckets(void* stream) {
  const uint64_t t0 = now_ns();
  reducer().finish(stream, Deadline::never());
  pass_.last_exposed_ns += now_ns() - t0;  // after the iteration's ddp_wait_grad waits
  pass_.exposed_ns += now_ns() - t0;
}

void Context::watch_stragglers() {
  const double warn = cfg_.c.straggler_warning_ms > 0 ? static_cast<double>(cfg_.c.straggler_warning_ms) : 100.0;
  const std::string warning = stragglers_.add(step_times_, rank(), warn);
  if (!warning.empty()) log(DDP_LOG_WARN, "libddp: %s", warning.c_str());
}

void Context::finish_backward(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (pass_.state != State::InBackward)
    fail(DDP_ERR_INVALID_STATE, "no backward pass in progress (call ddp_begin_backward first)");
  pass_.state = State::Idle;
  if (!pass_.synced) {  // no_sync: grads only accumulated locally
    report_.local_pass();
    set_call(Call::Idle);
    shards_reduced(false);
    return;
  }
  CallScope scope(this, Call::Finish, Call::Idle);
  std::string unused_text;
  fatal_on_error([&] {
    if (pass_.learning) {
      pass_.learning = false;
      learn_plan();
    }
    reducer().unready_grads(&pass_.unused);
    reducer().launch_rest();  // unused grads travel as zeros, so that no rank waits forever
    wait_buckets(stream);
    // The report is one more exchange between the ranks: after the buckets, so that a rank that died
    // or stalled is reported by the bucket that waited for it (step and bucket named). It carries the
    // straggler watch's times.
    const uint64_t end = now_ns();
    StepTimes mine;
    mine.begin = static_cast<int64_t>(end - pass_.begin_ns);
    mine.ready = static_cast<int64_t>(end - std::max(pass_.begin_ns, pass_.last_ready_ns));
    mine.entry = static_cast<int64_t>(end - std::min(end, std::max(pass_.begin_ns, reducer().latest_start_ns())));
    // (DDP_UNUSED_ZERO makes no exchange after the buckets, and none is added for the times: on GPUs
    // it would make the host wait for the device in every iteration. Elastic contexts always exchange:
    // the report carries what each rank's join watch saw; on GPUs it runs over the NCCL communicator's
    // Gloo control path, which does not wait for the device.)
    if (!cfg_.unused_zero() || cfg_.c.elastic) {
      static const std::vector<int> none;
      unused_text = report_.exchange(ctrl(), cfg_.unused_zero() ? none : pass_.unused, deadline(), true, mine,
                                     gen_->join_watch() ? gen_->join_watch()->upto() : 0);
      report_.times(&step_times_);
      watch_stragglers();
      book_.note_joins(report_.joins());
    }
  });
  report_.synced();
  ++pass_.iterations;
  shards_reduced(true);
  if (timeline_) {
    timeline_->iteration(pass_.iterations - 1, pass_.begin_ns, now_ns());
    timeline_->flush();
  }
  log_summary();
  if (!unused_text.empty())
    fail(DDP_ERR_INVALID_STATE,
         "grads never marked ready in this iteration (reduced as zeros): %s. Mark every "
         "grad ready each iteration, or set unused_policy = DDP_UNUSED_ZERO",
         unused_text.c_str());
}

void Context::set_sync(bool enabled) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (pass_.state == State::InBackward)
    fail(DDP_ERR_INVALID_STATE, "not allowed inside a backward pass (set it before ddp_begin_backward)");
  pass_.sync = enabled;
}

void Context::reduce_all(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (pass_.state == State::InBackward) fail(DDP_ERR_INVALID_STATE, "not allowed inside a backward pass");
  check_no_joiners(book_.pending_upto, book_.admitted_upto);
  CallScope scope(this, Call::ReduceAll, Call::Idle);
  progress_.iteration.store(static_cast<int64_t>(pass_.iterations), std::memory_order_relaxed);
  fatal_on_error([&] {
    commit_locked();
    if (cfg_.c.uneven_inputs != DDP_UNEVEN_OFF) vote(kReduceAll);
    reducer().begin(stream, pass_.iterations);
    pass_.last_exposed_ns = 0;
    reducer().launch_all();
    wait_buckets(stream);
    if (cfg_.c.elastic) {  // what the join watches saw, as after a backward pass
      (void)report_.exchange(ctrl(), std::vector<int>(), deadline(), false, StepTimes{-1, 0, 0},
                             gen_->join_watch() ? gen_->join_watch()->upto() : 0);
      book_.note_joins(report_.joins());
    }
  });
  report_.synced();
  ++pass_.iterations;
  shards_reduced(true);
}

}  // namespace ddp
