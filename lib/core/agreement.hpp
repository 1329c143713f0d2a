// Cross-rank agreement, on the context's control communicator: the config (at ddp_create), the
// registered grads and whether a comm hook is set (when registration closes), and the report of
// unused grads (at the end of a backward). Each is one fixed-size allgather when the ranks agree;
// only a difference costs more rounds, to name the first one identically on every rank. All throw
// DDP_ERR_MISMATCH on a difference (so no rank goes on alone), DDP_ERR_TIMEOUT when a rank does not
// answer by the deadline.
#pragma once

#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/plan.hpp"

namespace ddp {

// Every rank has the same agreed config fields and the same memory kind.
void agree_config(Comm& ctrl, const Settings& cfg, Deadline dl);

// Every rank registered the same grads (count, numel, dtype, flags, in order), and every rank set a
// comm hook (`hook`) or none: one exchange for both.
void agree_registration(Comm& ctrl, const std::vector<GradSpec>& specs, bool hook, Deadline dl);

// The unused-grad report of the error policy: every rank learns every rank's unused grads, so all
// return the same message. Keeps its buffer, so that nothing allocates per iteration.
class UnusedReport {
 public:
  // "rank 0: grads 3, 5; rank 2: grad 1", or empty when no rank has unused grads.
  std::string exchange(Comm& ctrl, const std::vector<int>& unused, Deadline dl);

 private:
  struct Info {
    int32_t count;
    int32_t first[6];
  };
  std::vector<Info> all_;
};

}  // namespace ddp
