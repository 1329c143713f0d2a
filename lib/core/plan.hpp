// The planner: which grads form which bucket, in which order buckets launch, and on which stream.
// Pure bookkeeping over grad sizes and dtypes; no memory, no communication.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/common.hpp"

namespace ddp {

struct GradSpec {
  size_t numel;
  Dtype dtype;
  unsigned flags;
};

struct Bucket {
  Dtype dtype;
  std::vector<int> grads;       // in bucket order (the order they were expected to become ready)
  std::vector<size_t> offsets;  // element offset of each grad in the flat bucket
  size_t numel = 0;
  int stream = 0;
};

struct Plan {
  std::vector<Bucket> buckets;  // in launch order
  std::vector<int> bucket_of;   // grad -> bucket
  std::vector<int> slot_of;     // grad -> position in its bucket
  bool learned = false;

  // Fills offsets, numel, streams and the grad maps from `buckets[*].grads`; checks that every grad
  // appears exactly once and that each bucket has one dtype (DDP_ERR_INTERNAL otherwise).
  void finalize(const std::vector<GradSpec>& specs, int num_streams);

  // A flat form for broadcasting: [num_buckets, size of each bucket..., grads in order...].
  // Always 1 + num_buckets + num_grads entries, at most 1 + 2 * num_grads.
  std::vector<int64_t> serialize() const;
  // The inverse; validates the input against `specs` (DDP_ERR_MISMATCH if it does not fit).
  static Plan deserialize(const int64_t* data, size_t n, const std::vector<GradSpec>& specs, int num_streams);
};

// Buckets over `order` (every grad once, in the order they are expected to become ready): one open
// bucket per dtype; a grad joins its dtype's bucket, which closes when it reaches message_size
// elements, or, when any grad carries DDP_GRAD_TRIGGER, exactly when a trigger grad joins (apex).
// Buckets launch in the order they close; leftovers follow in dtype order.
Plan build_plan(const std::vector<GradSpec>& specs, const std::vector<int>& order, size_t message_size,
                int num_streams);

// The registration plan: buckets over reverse registration order, known before any backward.
Plan registration_plan(const std::vector<GradSpec>& specs, size_t message_size, int num_streams);

// The learned plan (apex): records the order grads become ready in one backward pass, then builds
// buckets over it, grads never seen appended in reverse registration order.
class PlanLearner {
 public:
  void reset(size_t num_grads);
  void record(int grad) { order_.push_back(grad); }  // capacity reserved by reset: no allocation
  Plan finish(const std::vector<GradSpec>& specs, size_t message_size, int num_streams) const;

 private:
  std::vector<int> order_;
};

}  // namespace ddp
