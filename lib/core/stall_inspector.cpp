// The stall inspector (its vocabulary: core/inspector.hpp): this rank's position, the picture of every
// rank's (gathered by the communicator's prober, which never waits on a rank that does not answer),
// the stall warning, and the plan and summaries DDP_DEBUG=INFO asks for.
#include <algorithm>

#include "core/context.hpp"
#include "core/knobs.hpp"
#include "core/log.hpp"

namespace ddp {

namespace {

const char* call_text(int32_t c) {
  switch (static_cast<Call>(c)) {
    case Call::Idle: return "between calls";
    case Call::Commit: return "in ddp_commit";
    case Call::Backward: return "in backward (before ddp_finish_backward)";
    case Call::Finish: return "in ddp_finish_backward";
    case Call::ReduceAll: return "in ddp_reduce_all";
    case Call::Broadcast: return "in ddp_broadcast";
    case Call::Destroyed: return "in ddp_destroy";
    case Call::WaitParams: return "in ddp_wait_params";
    case Call::ShardNorm: return "in ddp_shard_norm";
    case Call::Join: return "in ddp_join";
    case Call::HostAllreduce: return "in ddp_allreduce_host";
    case Call::Barrier: return "in ddp_barrier";
    case Call::WaitGrad: return "in ddp_wait_grad (inside backward)";
  }
  return "in an unknown call";
}

std::string describe(const Position& p) {
  if (p.iteration == kAcceptedSilent) return "no answer (its port accepts: the process lives, stopped or paused)";
  if (p.iteration < 0) return "no answer";
  return format("iteration %lld, %s, %d of %d buckets launched, %d reduced, %lld control calls",
                static_cast<long long>(p.iteration), call_text(p.call), p.launched, p.buckets, p.done,
                static_cast<long long>(p.calls));
}

// Behind: an earlier iteration, or in the same one fewer buckets launched or fewer control-path
// exchanges entered (a rank that never reached the barrier, ddp_commit or the vote this one waits in).
bool behind(const Position& p, const Position& me) {
  if (p.iteration != me.iteration) return p.iteration < me.iteration;
  return p.launched < me.launched || p.calls < me.calls;
}

}  // namespace

Position Context::position() const {
  Position p;
  p.iteration = progress_.iteration.load(std::memory_order_relaxed);
  p.call = progress_.call.load(std::memory_order_relaxed);
  p.launched = progress_.launched.load(std::memory_order_relaxed);
  p.done = progress_.done.load(std::memory_order_relaxed);
  p.buckets = progress_.buckets.load(std::memory_order_relaxed);
  p.calls = progress_.calls.load(std::memory_order_relaxed);
  return p;
}

// "; no answer from rank 3 (...); behind this rank: rank 1. Ranks: 0 (this rank): ...; 1: ...": the
// ranks that did not answer within wait_ms, the ones that are behind this one, and everyone's position.
std::string Context::picture(int64_t wait_ms) {
  if (world_ == 1) return "";
  if (!prober_)
    return "; where the other ranks are is not known (this communicator cannot ask them without risking a hang)";
  std::vector<Position> all = prober_->ask(wait_ms);
  const Position me = all[static_cast<size_t>(rank_)];
  std::vector<int> missing, late;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const Position& p = all[static_cast<size_t>(r)];
    if (p.iteration < 0)
      missing.push_back(r);
    else if (behind(p, me))
      late.push_back(r);
  }
  std::string s;
  if (!missing.empty()) s += "; no answer from " + rank_list(missing) + " (dead, or stuck where it cannot answer)";
  if (!late.empty()) s += "; behind this rank: " + rank_list(late);
  if (missing.empty() && late.empty()) s += "; every rank answered and none is behind this one";
  s += ". Ranks:";
  for (int r = 0; r < world_; ++r)
    s += format("%s %d%s: %s", r ? ";" : "", r, r == rank_ ? " (this rank)" : "",
                describe(all[static_cast<size_t>(r)]).c_str());
  return s;
}

// Once per wait: every stream's waiting bucket would report the same stall.
void Context::stall_warning(int stream) {
  if (timeline_) timeline_->flush();  // a hang is often ended by a kill: its iteration so far goes to disk
  if (!log_enabled(DDP_LOG_WARN)) return;
  const int64_t it = progress_.iteration.load(std::memory_order_relaxed);
  if (warned_iteration_ == it) return;
  warned_iteration_ = it;
  const std::string where = reducer_ ? reducer_->stuck(stream) : format("stream %d: ", stream);
  const std::string pic = picture(500);
  log(DDP_LOG_WARN,
      "rank %d: %shas waited %lld ms for the other ranks (stall_warning_ms), and goes on waiting until "
      "timeout_ms (%lld ms)%s",
      rank_, where.c_str(), static_cast<long long>(stall_ms_), static_cast<long long>(cfg_.c.timeout_ms), pic.c_str());
}

void Context::log_plan() {
  if (!log_enabled(DDP_LOG_INFO) || !reducer_) return;
  const Plan& p = reducer_->plan();
  // The learned plan is adopted in ddp_finish_backward of the first synced iteration, before it counts.
  const std::string order =
      p.learned ? format("learned from the ready order of iteration %llu", static_cast<unsigned long long>(iterations_))
      : cfg_.learned() ? "registration order until learned"
                       : "registration";
  log(DDP_LOG_INFO, "rank %d: plan of %zu grads in %zu buckets (%s, %s layout)", rank_, specs_.size(), p.buckets.size(),
      order.c_str(), cfg_.arena() ? "arena" : "copy");
  for (size_t b = 0; b < p.buckets.size(); ++b) {
    const Bucket& bk = p.buckets[b];
    log(DDP_LOG_INFO, "rank %d:   bucket %zu: %zu grads, %zu elements of %s (wire %s), stream %d", rank_, b,
        bk.grads.size(), bk.numel, dtype_name(bk.dtype), dtype_name(reducer_->wire(static_cast<int>(b))), bk.stream);
  }
}

void Context::log_summary() {
  if (!log_enabled(DDP_LOG_INFO) || iterations_ % knobs::debug_every() != 0) return;
  log(DDP_LOG_INFO,
      "rank %d: iteration %llu: %llu buckets and %.1f MB reduced so far; exposed communication %.2f ms in the last "
      "iteration, %.2f ms per iteration on average",
      rank_, static_cast<unsigned long long>(iterations_),
      static_cast<unsigned long long>(stats_.buckets_reduced.load()), stats_.bytes_reduced.load() / 1e6,
      last_exposed_ns_ / 1e6, iterations_ ? exposed_ns_ / 1e6 / static_cast<double>(iterations_) : 0.0);
}

// A rank silent in two watches in a row (or whose port refused: its process is gone) is taken for lost: this rank
// closes its connections (as a bucket worker does when its collective fails), so that its own wait ends now and the
// loss reaches every rank, rather than at timeout_ms. (A send to a dead peer can wait for its whole timeout, and a cut
// link closes nothing.) A rank whose port accepts but which does not answer lives, stopped (a debugger, SIGSTOP, a
// paused machine): a stall, which timeout_ms bounds, as for a rank that answers.
void Context::watch_peers() {
  if (!prober_ || !reducer_env_.on_failure) return;
  const std::vector<Position> pos = prober_->ask(500);
  silent_.resize(pos.size(), 0);
  int gone = -1;
  for (size_t r = 0; r < pos.size(); ++r) {
    const bool stopped = pos[r].iteration == kAcceptedSilent;
    silent_[r] = stopped ? 0 : silent_asks(silent_[r], liveness_of(pos[r]));
    if (silent_[r] >= kLostAfterAsks && gone < 0) gone = static_cast<int>(r);
  }
  if (gone < 0) return;
  std::fill(silent_.begin(), silent_.end(), 0);
  log(DDP_LOG_WARN,
      "libddp: rank %d: rank %d does not answer (its process is gone, or it is cut off): this rank gives up on it "
      "and closes its connections",
      rank_, gone);
  reducer_env_.on_failure();
}

}  // namespace ddp
