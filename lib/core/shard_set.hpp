// Sharded contexts (config.shard): everything a rank's shards are, in one owner. Each bucket of the
// grad arena is padded into world equal shards (core/program.cpp); the shard set knows where this
// rank's shard of each bucket lies, keeps the parameter arena (laid out as the grad arena), launches
// each bucket's parameter all-gather on the bucket's stream (last bucket first: forward needs the
// first layers first) and waits for it bucket by bucket. The reducer owns it and gives it each new
// layout; the reduce-scatter itself is a step of the bucket program.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/program.hpp"

namespace ddp {

class ShardSet {
 public:
  struct Env {
    Device* device = nullptr;
    std::vector<Comm*> comms;      // one per stream
    std::vector<Stream*> streams;  // one per stream
    int rank = 0;
    int64_t timeout_ms = 0;
    bool workers = false;                   // host streams: the host waits for a gather's completion itself
    std::function<std::string(int)> where;  // "iteration I, bucket b of n (stream s): "
  };
  explicit ShardSet(Env env);
  ~ShardSet();
  ShardSet(const ShardSet&) = delete;
  ShardSet& operator=(const ShardSet&) = delete;

  // A new layout: `grads` is the grad arena, bucket b starting `base[b]` bytes into it, `total` bytes
  // in all. `move(fresh)` copies the parameters into the fresh parameter arena while the old one is
  // still readable (through param_of).
  void relayout(const Program& program, char* grads, const std::vector<size_t>& base, size_t total,
                const std::function<void(char* fresh)>& move);

  // This rank's shard of bucket b.
  struct View {
    Dtype dtype;
    size_t padded, shard_n, lo;  // the bucket's elements with padding, per rank, this rank's first
    size_t numel;                // of them, grads' elements
    size_t arena_byte;           // the shard's first byte, from the arena's start
    char* grad;
    char* param;
  };
  View view(int b) const;
  // The parameter of the grad at `grad` (a pointer into the grad arena).
  void* param_of(const void* grad) const { return params_ + (static_cast<const char*>(grad) - grads_); }
  char* params() const { return params_; }
  uint64_t bytes() const { return params_ ? total_ : 0; }

  // Launches every bucket's parameter all-gather, the last bucket first, after `user_stream`'s work.
  void launch_gather(void* user_stream);
  // Waits for bucket b's gather (host) or makes `user_stream` wait for it (GPU).
  void wait_gathered(int b, void* user_stream);
  // out[0] += the sum of squares of this rank's shards' finite elements, out[1] += their NaN/Inf.
  void norm_terms(void* user_stream, double out[2]);

 private:
  struct GatherTask;
  void gather(int b, uint64_t epoch);
  Stream& stream_of(int b) const;

  Env env_;
  const Program* program_ = nullptr;
  char* grads_ = nullptr;   // the grad arena (the reducer's)
  char* params_ = nullptr;  // the parameter arena, laid out as the grad arena
  size_t total_ = 0;
  std::vector<size_t> base_;                        // per bucket: its first byte in either arena
  std::vector<std::unique_ptr<GatherTask>> tasks_;  // per bucket
  uint64_t epoch_ = 0;
  Deadline deadline_;
};

}  // namespace ddp
