// The reducer: a plan brought to life. It owns the bucket buffers (per-stream staging for the copy
// layout, the arena for the arena layout), counts ready grads into bucket slots, launches complete
// buckets strictly in plan order (apex's next_bucket) onto stream i % num_streams, and runs each
// bucket's program (core/program.hpp: decided once per plan) step by step: in (pack or pre-scale),
// the collective, out (unpack or post-scale, scan, accounting).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/int8_wire.hpp"
#include "core/plan.hpp"
#include "core/program.hpp"
#include "core/shard_set.hpp"
#include "core/timeline.hpp"

namespace ddp {

// The counters behind ddp_get_stats, added to by the reducer's tasks (worker threads).
struct Stats {
  std::atomic<uint64_t> buckets_reduced{0};
  std::atomic<uint64_t> bytes_reduced{0};
  std::atomic<uint64_t> comm_time_ns{0};
  std::atomic<uint64_t> nonfinite_buckets{0};
};

// A comm hook's call: bucket `bucket`'s buffer of `count` elements of `dtype`, to be summed across the
// ranks in place, in order on `stream` over `comm`, by `deadline`.
struct HookCall {
  int bucket, stream_index;
  uint64_t iteration;
  void* buffer;
  size_t count;
  Dtype dtype;
  Stream* stream;
  Comm* comm;
  Deadline deadline;
};

// What a reducer needs from its context: settings and the backend objects, all owned elsewhere.
struct ReducerEnv {
  Device* device = nullptr;
  std::vector<Comm*> comms;      // one per stream
  std::vector<Stream*> streams;  // one per stream
  ProgramSettings program;       // what the bucket programs are compiled from
  bool check_finite = false;
  int64_t timeout_ms = 0;
  std::function<void(const HookCall&)> hook;  // a comm hook instead of the collectives (none: empty)
  Stats* stats = nullptr;
  Progress* progress = nullptr;
  Timeline* timeline = nullptr;
  // Elastic contexts: called on the worker whose collective failed for a lost peer (a timeout or an
  // aborted exchange), before the error reaches the stream: severs every connection of the context,
  // so that the ranks and the workers blocked on this one fail now. Empty: nothing.
  std::function<void()> on_failure;
};

class Reducer {
 public:
  Reducer(const ReducerEnv& env, const std::vector<GradSpec>& specs);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Adopts `plan`: builds the bucket runtime and allocates buffers. Copy layout: `user_ptrs` are the
  // grads. Arena layout: storage is allocated; grads already in an older arena keep their values.
  void adopt(Plan plan, const std::vector<void*>& user_ptrs);
  const Plan& plan() const { return plan_; }

  // Where grad g lives now.
  void* grad_ptr(int g) const;
  // Copy layout: grad g moved to p (marks its bucket's pointer table changed only if it did).
  void set_grad_ptr(int g, void* p);

  // A new iteration: every slot empty, nothing launched.
  void begin(void* user_stream, uint64_t iteration);
  // Grad g is ready. Returns false if it was already marked (the caller reports that). When `launch`,
  // complete buckets are launched in plan order.
  bool mark_ready(int g, bool launch, uint64_t t_ns);
  bool is_ready(int g) const { return ready_[static_cast<size_t>(g)] != 0; }
  // Grads not marked ready, in registration order.
  void unready_grads(std::vector<int>* out) const;
  // Marks every unready grad as a zero contribution and launches everything not yet launched, in
  // plan order. Zero flags persist in the tables until the set of zero grads changes.
  void launch_rest();
  // Reduces every grad now (apex Reducer): all slots full, none zero.
  void launch_all();
  // Waits for every launched bucket (host), or makes `user_stream` wait for them (GPU), then checks
  // the epilogue (every bucket launched and finished). Rethrows a bucket's error.
  void finish(void* user_stream, Deadline dl);
  // Whether grad g's bucket was launched in this iteration (launches go in plan order: a bucket waits
  // for its own grads and for every bucket before it).
  bool launched_grad(int g) const { return plan_.bucket_of[static_cast<size_t>(g)] < next_; }
  // Waits for grad g's bucket (launched): host memory returns once its work has finished (later
  // buckets may still run); GPU makes `user_stream` wait for it. Rethrows its stream's error.
  void wait_grad(int g, void* user_stream, Deadline dl);
  // Stops queued work after a fatal error.
  void cancel();
  // Averages divide by `divisor` ranks from the next launch on (uneven inputs: the contributors).
  void set_divisor(int divisor);
  int divisor() const { return divisor_; }

  // Sharded contexts: the shards, the parameter arena and its gathers.
  ShardSet& shards();

  uint64_t buffer_bytes() const {
    return staging_bytes_ + arena_bytes_ + (shards_ ? shards_->bytes() : 0) + int8_.bytes();
  }
  // The int8 wire: forgets every kept rounding error (a rank that joins contributes zeros from then on).
  void clear_feedback();
  uint64_t arena_bytes() const { return arena_bytes_; }
  // When the last bucket of the iteration started its work on its stream (after finish: the streams
  // are drained, so the workers' writes are seen). 0 when none started.
  uint64_t latest_start_ns() const;
  int launched() const { return next_; }
  // The type bucket b is summed in (16-bit buckets travel as f32 where the engine cannot sum them).
  Dtype wire(int b) const {
    const BucketProgram& p = program_.buckets[static_cast<size_t>(b)];
    return p.ring_cast ? p.send : p.wire;
  }
  const Program& program() const { return program_; }
  // Where stream `stream` stands: "iteration I, bucket b of n (stream s): " for its first launched
  // bucket that has not finished.
  std::string stuck(int stream) const;

 private:
  enum class Step { Whole, In, Collectives, Out };
  struct StepTask;
  struct BucketRt;
  // What a bucket's work touches: its program, its runtime, its stream, the device, its comm.
  struct Work {
    const BucketProgram& p;
    BucketRt& r;
    Stream& s;
    Device& d;
    Comm& c;
  };
  Work work(int b);
  void build_runtime(const std::vector<void*>& ptrs);
  void reserve_tasks();
  Stream& stream_of(int b);
  void launch(int b);
  void launch_grouped(int first, int last);
  void launch_ready_in_order();
  void run_step(int b, Step step);
  // A bucket's steps: in (pack or pre-scale), the collectives, out (unpack or post-scale, the scan,
  // the accounting); pieces: the whole bucket piece by piece with every pass fused into the pieces.
  void step_in(int b);
  void step_collectives(int b, bool own_group);
  void step_out(int b);
  void pieces(int b);
  void reduce_in_place(int b, void* p, size_t n);
  // What an int8 collective that reads the grads itself works on: the grads (copy layout), or the
  // arena's bucket `buf` as one segment (*arena).
  SegmentTable& grads_table(const BucketProgram& p, BucketRt& r, void* buf, size_t n, SegmentTable* arena);
  bool int8_reads_grads(const BucketProgram& p) const { return Int8Wire::reads_grads(p, env_.device->memory()); }
  void* buffer(int b) const;  // what the collective runs on: the staging range or the arena storage
  const void* direct_source(const BucketProgram& p, const BucketRt& r, Span sp, size_t* seg) const;
  void scan(int b, const void* p, size_t n);
  void scan_packed(int b, Span span, size_t* cursor);
  void account(int b);
  std::string where(int b) const;
  void set_zero(int g, bool zero);

  const ReducerEnv& env_;  // the context's, for the reducer's life: settings flow from there
  const std::vector<GradSpec>& specs_;
  std::vector<Capabilities> caps_;  // per stream's communicator
  bool workers_ = false;            // host streams: a worker thread runs each task to completion
  Plan plan_;
  Program program_;
  std::vector<std::unique_ptr<BucketRt>> rt_;
  std::vector<char> ready_;     // per grad, this iteration
  std::vector<char> zero_;      // per grad, as the tables have it
  std::vector<void*> staging_;  // per stream (staged buckets)
  void* staging(int b) const;   // bucket b's range of its stream's staging buffer
  std::unique_ptr<BucketRt> make_bucket(size_t b, const std::vector<void*>& ptrs) const;
  uint64_t staging_bytes_ = 0;
  char* arena_ = nullptr;             // arena layout: every bucket's storage, bucket after bucket
  std::unique_ptr<ShardSet> shards_;  // sharded contexts
  Int8Wire int8_;                     // the int8 wire's kept errors and exchange buffers
  uint64_t arena_bytes_ = 0;
  int next_ = 0;  // the next bucket to launch, in plan order
  void* user_stream_ = nullptr;
  uint64_t iteration_ = 0;
  int divisor_ = 1;
};

}  // namespace ddp
