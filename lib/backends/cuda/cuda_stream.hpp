// A bucket stream of the CUDA device, and what it knows of the work enqueued on it: the deadlines of
// its collectives, the communicators that enqueued them, and the marks that say which bucket is done.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/cuda/cuda_calls.hpp"
#include "backends/cuda/watchdog.hpp"
#include "core/backend.hpp"

namespace ddp {

// A bucket stream: a non-blocking CUDA stream. Tasks run on the submitting thread and only enqueue.
// The watchdog checks its oldest unfinished collective against that collective's deadline and, past
// it, aborts the communicators that enqueued work here (NCCL then releases every kernel waiting on a
// dead peer, the user's synchronizations included); the next call reports the timeout.
class CudaStream final : public Stream, public Watched {
 public:
  CudaStream(int device, int index);
  ~CudaStream() override;
  void reserve(size_t) override {}
  void submit(Task* task) override;
  void drain(Deadline deadline) override;
  bool runs_inline() const override { return true; }
  void* native() override { return stream_; }
  void poll_error() override;
  void cancel() override { cancelled_ = true; }
  void set_stall_warning(int64_t ms, std::function<void()> warn) override {
    stall_ms_ = ms;
    stall_warn_ = std::move(warn);
  }
  // Elastic contexts: a drain still waiting after `ms` asks `check` (which may sever the
  // communicators: the waited-for work then fails) and again every `ms` while it waits.
  void set_peer_watch(int64_t ms, std::function<void()> check) override {
    peer_ms_ = ms;
    peer_check_ = std::move(check);
  }

  cudaStream_t stream() const { return stream_; }
  // The user's stream -> this stream, and back (one event each, reused: recording again is safe
  // because waits capture the event's state when they are enqueued).
  cudaEvent_t in_event() const { return in_event_; }
  cudaEvent_t out_event() const { return out_event_; }
  void watch(AsyncErrorSource* src, Deadline dl) override;
  bool finishes_later(int tag, std::atomic<int32_t>* done) override;
  int oldest_unfinished() override;
  void user_wait_tag(void* user_stream, int tag) override;
  void scan() override;
  // Host waits for `e` (recorded on this stream), bounded as drain is.
  void wait_event(cudaEvent_t e);
  // Whether work of this stream was written off (a collective past its deadline): its buffers may
  // still be written by kernels that never finish, so they are not freed.
  const std::shared_ptr<std::atomic<bool>>& abandoned() const { return abandoned_; }

 private:
  // True when every enqueued operation has finished. Throws on a CUDA error, an asynchronous error
  // of a watched source, or a collective past its deadline.
  bool idle();
  // Under mu_: drops the finished marks at the front (counting them done) and says whether the
  // oldest unfinished work is past its deadline.
  bool late_locked(bool stream_idle);
  bool late();
  [[noreturn]] void fail_late();

  // A point of the stream (an event recorded after a bucket's work) and the deadline of the
  // collectives enqueued before it.
  struct Mark {
    cudaEvent_t event;
    Deadline deadline;
    bool has_deadline;
    int tag;
    std::atomic<int32_t>* done;
  };

  int device_, index_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t in_event_ = nullptr, out_event_ = nullptr;
  std::atomic<bool> cancelled_{false};  // set by the reducer, read by the watchdog
  std::mutex mu_;  // guards what the watchdog reads: sources_, marks_, the unmarked deadline, late_
  std::vector<AsyncErrorSource*> sources_;
  std::deque<Mark> marks_;
  std::vector<cudaEvent_t> spare_;  // events of finished marks, for reuse
  int64_t peer_ms_ = 0;
  std::function<void()> peer_check_;
  Deadline unmarked_;  // the oldest deadline of collectives enqueued after the last mark
  bool has_unmarked_ = false;
  bool late_ = false;  // the watchdog found a collective past its deadline and aborted its sources
  int late_tag_ = -1;  // the oldest bucket not finished when the stream was found late (-1: none marked)
  std::shared_ptr<std::atomic<bool>> abandoned_ = std::make_shared<std::atomic<bool>>(false);
  int64_t stall_ms_ = 0;
  std::function<void()> stall_warn_;
};

}  // namespace ddp
