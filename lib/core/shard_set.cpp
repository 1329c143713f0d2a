#include "core/shard_set.hpp"

#include <chrono>
#include <thread>

namespace ddp {

// A bucket's parameter all-gather: a task of its own, since it may still be queued when the bucket's
// next reduction is submitted.
struct ShardSet::GatherTask final : Task {
  ShardSet* set = nullptr;
  int bucket = 0;
  uint64_t epoch = 0;
  std::atomic<uint64_t> gathered{0};  // host: the epoch of the last gather that completed
  void run() override {
    try {
      set->gather(bucket, epoch);
    } catch (const Error& e) {
      throw Error(e.status(), set->env_.where(bucket) + "parameter gather: " + e.what());
    }
  }
};

ShardSet::ShardSet(Env env) : env_(std::move(env)) {}

// The device decides whether the arena can be freed: one a gather it had to abandon may still write
// is kept by the backend that could not cancel it.
ShardSet::~ShardSet() { env_.device->release(params_); }

void ShardSet::relayout(const Program& program, char* grads, const std::vector<size_t>& base, size_t total,
                        const std::function<void(char* fresh)>& move) {
  char* fresh = static_cast<char*>(env_.device->alloc(total));
  if (params_) move(fresh);
  env_.device->release(params_);
  params_ = fresh;
  program_ = &program;
  grads_ = grads;
  base_ = base;
  total_ = total;
  tasks_.clear();
  for (size_t b = 0; b < base.size(); ++b) {
    tasks_.emplace_back(new GatherTask());
    tasks_.back()->set = this;
    tasks_.back()->bucket = static_cast<int>(b);
  }
  env_.device->reserve_marks(base.size());
}

ShardSet::View ShardSet::view(int b) const {
  const BucketProgram& p = program_->buckets[static_cast<size_t>(b)];
  View v;
  v.dtype = p.dtype;
  v.padded = p.padded;
  v.shard_n = p.shard_n;
  v.lo = static_cast<size_t>(env_.rank) * p.shard_n;
  v.numel = p.numel;
  v.arena_byte = base_[static_cast<size_t>(b)] + v.lo * dtype_size(p.dtype);
  v.grad = grads_ + v.arena_byte;
  v.param = params_ + v.arena_byte;
  return v;
}

Stream& ShardSet::stream_of(int b) const {
  return *env_.streams[static_cast<size_t>(program_->buckets[static_cast<size_t>(b)].stream)];
}

void ShardSet::gather(int b, uint64_t epoch) {
  const BucketProgram& p = program_->buckets[static_cast<size_t>(b)];
  Stream& s = stream_of(b);
  env_.comms[static_cast<size_t>(p.stream)]->allgather(params_ + base_[static_cast<size_t>(b)],
                                                       p.shard_n * dtype_size(p.dtype), s, deadline_);
  if (!env_.workers) env_.device->mark(static_cast<size_t>(b), s);
  tasks_[static_cast<size_t>(b)]->gathered.store(epoch, std::memory_order_release);
}

// In the order a forward pass needs the parameters: the plan's buckets follow backward's order, so
// its last bucket holds the first layers.
void ShardSet::launch_gather(void* user_stream) {
  ++epoch_;
  deadline_ = Deadline::after_ms(env_.timeout_ms);
  for (Stream* s : env_.streams) env_.device->stream_wait_user(*s, user_stream);
  for (size_t b = tasks_.size(); b-- > 0;) {
    tasks_[b]->epoch = epoch_;
    stream_of(static_cast<int>(b)).submit(tasks_[b].get());
  }
}

void ShardSet::wait_gathered(int b, void* user_stream) {
  Stream& s = stream_of(b);
  if (!env_.workers) {
    env_.device->user_wait_mark(user_stream, static_cast<size_t>(b));
    s.poll_error();
    return;
  }
  const GatherTask& t = *tasks_[static_cast<size_t>(b)];
  for (unsigned spin = 0; t.gathered.load(std::memory_order_acquire) < epoch_; ++spin) {
    s.poll_error();
    if (deadline_.passed())
      fail(DDP_ERR_TIMEOUT,
           "%sthe parameter gather did not complete before the timeout: another rank stalled, died or "
           "issued a different collective",
           env_.where(b).c_str());
    if (spin < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(spin < 4096 ? 20 : 500));
  }
}

void ShardSet::norm_terms(void* user_stream, double out[2]) {
  for (Stream* s : env_.streams) env_.device->stream_wait_user(*s, user_stream);
  for (size_t b = 0; b < tasks_.size(); ++b) {
    const View v = view(static_cast<int>(b));
    env_.device->norm_terms(v.grad, v.shard_n, v.dtype, stream_of(static_cast<int>(b)), out);
  }
}

}  // namespace ddp
