// Cross-rank agreement, on the context's control communicator: the config (at ddp_create), the
// registered grads and whether a comm hook is set (when registration closes), and the report of
// unused grads (at the end of a backward). Each is one fixed-size allgather when the ranks agree;
// only a difference costs more rounds, to name the first one identically on every rank. All throw
// DDP_ERR_MISMATCH on a difference (so no rank goes on alone), DDP_ERR_TIMEOUT when a rank does not
// answer by the deadline.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/config.hpp"
#include "core/join_protocol.hpp"
#include "core/plan.hpp"
#include "core/stragglers.hpp"

namespace ddp {

// What a rank is doing on the control path. Each exchange there that a rank's own order of calls
// reaches (ddp_barrier, ddp_allreduce_host, ddp_broadcast, ddp_shard_norm, uneven inputs' vote, the
// registration check, the end of a synced iteration) sends a record of this size that begins with its
// kind: ranks in different calls then meet in an exchange of equal sizes and name each other's call
// (DDP_ERR_MISMATCH), where records of different sizes would be a transport's error, or its abort.
enum CallKind : int32_t {
  kVote = 1,
  kHostAllreduce = 2,
  kBarrier = 3,
  kBroadcast = 4,
  kShardNorm = 5,
  kRegistration = 6,
  kIterationEnd = 7,
};
constexpr size_t kCallRecordBytes = 72;
struct CallRecord {
  int32_t kind = 0, dtype = 0, op = 0, flag = 0;  // what they mean depends on the kind (describe_call)
  uint64_t count = 0;
  unsigned char unused[kCallRecordBytes - 24] = {};
};
static_assert(sizeof(CallRecord) == kCallRecordBytes, "every call record has one size");

// "ddp_barrier", "ddp_allreduce_host(4 elements of f32, sum)", ... from any record's bytes.
std::string describe_call(const void* record);
// Fails with DDP_ERR_MISMATCH, naming both calls, when a rank's record in `all` (world records of
// kCallRecordBytes) is of another kind than rank `me`'s. Every rank sees every record, so all fail.
void check_same_call_kind(const void* all, int world, int me);

// Every rank has the same agreed config fields and the same memory kind.
void agree_config(Comm& ctrl, const Settings& cfg, Deadline dl);

// What a rank that joins a running elastic job must share with it (core/join_protocol.hpp).
JoinTerms join_terms(const Settings& cfg, Memory memory, const std::vector<GradSpec>& specs, bool hook);

// Every rank registered the same grads (count, numel, dtype, flags, in order), and every rank set a
// comm hook (`hook`) or none: one exchange for both.
void agree_registration(Comm& ctrl, const std::vector<GradSpec>& specs, bool hook, Deadline dl);

// FNV-1a, the digest of what the ranks compare in one exchange: mix() each value's 8 bytes, or add()
// raw bytes.
struct Digest {
  uint64_t h = 1469598103934665603ull;
  void add(const void* p, size_t n) {
    const unsigned char* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  void mix(uint64_t v) {
    for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xffu)) * 1099511628211ull;
  }
};

// `what` ("grad 3", "buf") at `p` holds elements of `align` bytes of type `dtype`: the element loops
// load whole elements, so `p` must be aligned to them (DDP_ERR_INVALID_ARGUMENT otherwise).
void check_aligned(const void* p, size_t align, const char* dtype, const std::string& what);
// A grad's own checks on this rank (no exchange): its pointer is aligned to its element, at
// registration and whenever the pointer moves.
void check_grad_aligned(const void* grad, Dtype d, int index);
// The memory the registered grads claim, so that no byte is claimed twice (one buffer registered twice
// would be reduced twice). Kept sorted by address: a registration costs O(log n), not a scan.
class ClaimedMemory {
 public:
  // Grad `index`, `numel` elements of `d` at `grad`, claims its bytes; throws DDP_ERR_INVALID_ARGUMENT
  // naming both grads if an earlier claim shares a byte with it (nothing is claimed then).
  void claim(int index, const void* grad, size_t numel, Dtype d);

 private:
  struct Claim {
    uintptr_t hi;
    int index;
  };
  std::map<uintptr_t, Claim> by_start_;
};

// Ranks that disagree on ddp_set_sync: `passes[r]` is how many backward passes rank r ran with sync
// off before the synced iteration it is in now (-1: not compared, a joined rank). Throws
// DDP_ERR_MISMATCH naming the ranks on each side when the compared ones differ.
void check_sync_agreement(const std::vector<int32_t>& passes);

// The report that ends each synced iteration, one record from every rank: its unused grads (the error
// policy's message: every rank learns every rank's, so all return the same message), its passes with
// sync off since the last synced iteration (check_sync_agreement: ranks that disagree on ddp_set_sync
// fail at the first synced iteration they pair wrongly), its times (the straggler watch) and how far
// its join watch has read (elastic joins). Keeps its buffer, so that nothing allocates per iteration.
class IterationReport {
 public:
  // "rank 0: grads 3, 5; rank 2: grad 1", or empty when no rank has unused grads. `compare_sync`
  // false: this rank's passes are not compared (a joined rank's shadow iteration).
  // The same exchange carries each rank's times of the iteration (the straggler watch's; a rank with
  // none sends begin -1), read back with times().
  // It also carries how far this rank's join watch has read (`joins`), read back (the most of any
  // rank) with joins().
  std::string exchange(Comm& ctrl, const std::vector<int>& unused, Deadline dl, bool compare_sync = true,
                       const StepTimes& mine = StepTimes{-1, 0, 0}, int64_t joins = 0);
  void times(std::vector<StepTimes>* out) const;
  int64_t joins() const;
  // A backward pass with sync off ended (its grads only accumulated); a synced reduction ended.
  void local_pass() { ++local_passes_; }
  void synced() { local_passes_ = 0; }
  int32_t local_passes() const { return local_passes_; }

 private:
  struct Info {
    int32_t kind;  // kIterationEnd (a call record's size and first field)
    int32_t count;
    int32_t first[6];
    int32_t local_passes;  // -1: not compared
    int32_t pad;
    StepTimes times;
    int64_t joins;
  };
  static_assert(sizeof(Info) == kCallRecordBytes, "the end of an iteration travels as a call record");
  std::vector<Info> all_;
  std::vector<int32_t> passes_;
  int32_t local_passes_ = 0;
};

}  // namespace ddp
