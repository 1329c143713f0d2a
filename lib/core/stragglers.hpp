// Stragglers: which rank made the others wait in each synced iteration, and why. Every rank reports
// three times, each measured back from the iteration's end on its own clock (the last bucket
// completes at nearly the same moment on every rank, so no clocks need to agree): when it began its
// backward pass, when it marked its last grad ready, and when its last bucket's collective started.
// Against the earliest rank for each, a rank's lateness splits into input (began late), compute
// (finished its backward later still) and wire (started its last collective later still).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "ddp.h"

namespace ddp {

// One rank's times of one synced iteration: nanoseconds before the iteration's end.
struct StepTimes {
  int64_t begin = 0, ready = 0, entry = 0;
};

class StragglerWatch {
 public:
  // The window of this rank's lateness, the steps a warning looks back on and how many of them
  // must be late, and the least lateness that names a straggler at all.
  static constexpr size_t kWindow = 100, kWarnSteps = 10, kWarnLate = 8;
  static constexpr double kNameMs = 2.0;

  // Every rank's times of one synced iteration (index: rank; begin < 0: a rank that measured nothing).
  // Returns a warning's text, or "".
  std::string add(const std::vector<StepTimes>& all, int rank, double warn_ms);
  void fill(ddp_stats_t& s) const;
  // The ranks were renumbered (an elastic recovery): what was measured of the old world is dropped.
  void reset() { *this = StragglerWatch(); }

 private:
  int rank_ = -1, kind_ = DDP_LATE_NONE;
  double ms_ = 0;
  std::deque<double> mine_[3];  // this rank's input, compute and wire lateness
  std::deque<int> flagged_;     // per step, the rank late by warn_ms or more (-1: none)
  bool warned_ = false;         // the warning for the current run of late steps is out
  uint64_t warnings_ = 0;
};

}  // namespace ddp
