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
  if (world() == 1) return "";
  Prober* prober = gen_ ? gen_->prober() : nullptr;
  if (!prober)
    return "; where the other ranks are is not known (this communicator cannot ask them without risking a hang)";
  std::vector<Position> all = prober->ask(wait_ms);
  const Position me = all[static_cast<size_t>(rank())];
  std::vector<int> missing, late;
  for (int r = 0; r < world(); ++r) {
    if (r == rank()) continue;
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
  for (int r = 0; r < world(); ++r)
    s += format("%s %d%s: %s", r ? ";" : "", r, r == rank() ? " (this rank)" : "",
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
  const std::string where = gen_ && gen_->reducer() ? reducer().stuck(stream) : format("stream %d: ", stream);
  const std::string pic = picture(500);
  log(DDP_LOG_WARN,
      "rank %d: %shas waited %lld ms for the other ranks (stall_warning_ms), and goes on waiting until "
      "timeout_ms (%lld ms)%s",
      rank(), where.c_str(), static_cast<long long>(cfg_.stall_warning_ms()), static_cast<long long>(cfg_.c.timeout_ms),
      pic.c_str());
}

void Context::log_plan() {
  if (!log_enabled(DDP_LOG_INFO) || !gen_ || !gen_->reducer()) return;
  const Plan& p = reducer().plan();
  // The learned plan is adopted in ddp_finish_backward of the first synced iteration, before it counts.
  const std::string order = p.learned        ? format("learned from the ready order of iteration %llu",
                                                      static_cast<unsigned long long>(pass_.iterations))
                            : cfg_.learned() ? "registration order until learned"
                                             : "registration";
  log(DDP_LOG_INFO, "rank %d: plan of %zu grads in %zu buckets (%s, %s layout)", rank(), regs_.specs.size(),
      p.buckets.size(), order.c_str(), cfg_.arena() ? "arena" : "copy");
  for (size_t b = 0; b < p.buckets.size(); ++b) {
    const Bucket& bk = p.buckets[b];
    log(DDP_LOG_INFO, "rank %d:   bucket %zu: %zu grads, %zu elements of %s (wire %s), stream %d", rank(), b,
        bk.grads.size(), bk.numel, dtype_name(bk.dtype), dtype_name(reducer().wire(static_cast<int>(b))), bk.stream);
  }
}

void Context::log_summary() {
  if (!log_enabled(DDP_LOG_INFO) || pass_.iterations % knobs::debug_every() != 0) return;
  log(DDP_LOG_INFO,
      "rank %d: iteration %llu: %llu buckets and %.1f MB reduced so far; exposed communication %.2f ms in the last "
      "iteration, %.2f ms per iteration on average",
      rank(), static_cast<unsigned long long>(pass_.iterations),
      static_cast<unsigned long long>(stats_.buckets_reduced.load()), stats_.bytes_reduced.load() / 1e6,
      pass_.last_exposed_ns / 1e6,
      pass_.iterations ? pass_.exposed_ns / 1e6 / static_cast<double>(pass_.iterations) : 0.0);
}

}  // namespace ddp
