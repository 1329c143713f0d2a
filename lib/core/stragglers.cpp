#include "core/stragglers.hpp"

#include <algorithm>

#include "core/common.hpp"

namespace ddp {

namespace {

double percentile(std::deque<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

const char* why(int kind) {
  switch (kind) {
    case DDP_LATE_INPUT: return "input: it began its backward pass late";
    case DDP_LATE_COMPUTE: return "compute: its backward pass ran slow";
    default: return "wire: its collectives started late";
  }
}

}  // namespace

std::string StragglerWatch::add(const std::vector<StepTimes>& all, int rank, double warn_ms) {
  // The earliest rank of each event is the reference: the longest time before the end.
  StepTimes first;
  for (const StepTimes& t : all) {
    if (t.begin < 0) continue;  // a joined rank's shadow iteration: nothing measured
    first.begin = std::max(first.begin, t.begin);
    first.ready = std::max(first.ready, t.ready);
    first.entry = std::max(first.entry, t.entry);
  }
  rank_ = -1, kind_ = DDP_LATE_NONE, ms_ = 0;
  int flagged = -1;
  double worst_total = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].begin < 0) continue;
    const double lb = static_cast<double>(first.begin - all[r].begin) / 1e6;
    const double lr = static_cast<double>(first.ready - all[r].ready) / 1e6;
    const double le = static_cast<double>(first.entry - all[r].entry) / 1e6;
    const double late[3] = {lb, std::max(0.0, lr - lb), std::max(0.0, le - std::max(lr, lb))};
    for (int k = 0; k < 3; ++k)
      if (late[k] > ms_) rank_ = static_cast<int>(r), kind_ = DDP_LATE_INPUT + k, ms_ = late[k];
    if (static_cast<int>(r) == rank)
      for (int k = 0; k < 3; ++k) {
        mine_[k].push_back(late[k]);
        if (mine_[k].size() > kWindow) mine_[k].pop_front();
      }
    const double total = std::max({lb, lr, le});
    if (total >= warn_ms && total > worst_total) flagged = static_cast<int>(r), worst_total = total;
  }
  if (ms_ < kNameMs) rank_ = -1, kind_ = DDP_LATE_NONE, ms_ = 0;
  flagged_.push_back(flagged);
  if (flagged_.size() > kWarnSteps) flagged_.pop_front();
  if (flagged < 0 || std::count(flagged_.begin(), flagged_.end(), flagged) < static_cast<long>(kWarnLate)) {
    if (std::count(flagged_.begin(), flagged_.end(), -1) == static_cast<long>(flagged_.size())) warned_ = false;
    return "";
  }
  if (warned_) return "";
  warned_ = true;
  ++warnings_;
  return format(
      "rank %d is a straggler: late by %.1f ms in this iteration (%s), and by %.0f ms or more in %zu of the "
      "last %zu synced iterations",
      flagged, worst_total, flagged == rank_ ? why(kind_) : "by several causes", warn_ms,
      static_cast<size_t>(std::count(flagged_.begin(), flagged_.end(), flagged)), flagged_.size());
}

void StragglerWatch::fill(ddp_stats_t& s) const {
  s.straggler_rank = rank_;
  s.straggler_kind = kind_;
  s.straggler_ms = ms_;
  s.late_input_p50_ms = percentile(mine_[0], 0.5);
  s.late_input_p99_ms = percentile(mine_[0], 0.99);
  s.late_compute_p50_ms = percentile(mine_[1], 0.5);
  s.late_compute_p99_ms = percentile(mine_[1], 0.99);
  s.late_wire_p50_ms = percentile(mine_[2], 0.5);
  s.late_wire_p99_ms = percentile(mine_[2], 0.99);
  s.straggler_warnings = warnings_;
}

}  // namespace ddp
