// The bucket streams: enqueueing, the marks that say which bucket is done, the host's bounded waits
// (drain), and the watchdog's scan that aborts the communicators of a collective past its deadline.
#include "backends/cuda/cuda_stream.hpp"

#include <sched.h>

#include <chrono>
#include <string>
#include <thread>

namespace ddp {

CudaStream::CudaStream(int device, int index) : device_(device), index_(index) {
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  DDP_CUDA_CHECK(cudaEventCreateWithFlags(&in_event_, cudaEventDisableTiming));
  DDP_CUDA_CHECK(cudaEventCreateWithFlags(&out_event_, cudaEventDisableTiming));
  watchdog_register(this);
}

CudaStream::~CudaStream() {
  watchdog_unregister(this);
  // Resources of a stream with work still queued are released when that work completes.
  DeviceGuard g(device_, true);
  for (const Mark& m : marks_) cudaEventDestroy(m.event);
  for (cudaEvent_t e : spare_) cudaEventDestroy(e);
  if (in_event_) cudaEventDestroy(in_event_);
  if (out_event_) cudaEventDestroy(out_event_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaStream::submit(Task* task) {
  if (cancelled_) return;
  DeviceGuard g(device_);
  task->run();
}

// Inside an NCCL group the collective is only enqueued at the group's end, so no event is recorded
// here: its deadline waits for the next mark (finishes_later), recorded after the group.
void CudaStream::watch(AsyncErrorSource* src, Deadline dl) {
  std::lock_guard<std::mutex> lock(mu_);
  bool known = false;
  for (AsyncErrorSource* s : sources_) known = known || s == src;
  if (!known) sources_.push_back(src);  // a handful per stream, added on first use only
  if (!dl.infinite() && (!has_unmarked_ || dl.at() < unmarked_.at())) {
    unmarked_ = dl;  // the oldest: later work must not hide a collective stuck before it
    has_unmarked_ = true;
  }
}

bool CudaStream::finishes_later(int tag, std::atomic<int32_t>* done) {
  cudaEvent_t e = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!spare_.empty()) {
      e = spare_.back();
      spare_.pop_back();
    }
  }
  DeviceGuard g(device_);
  if (!e) DDP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));  // until the pool is large enough
  const cudaError_t rc = cudaEventRecord(e, stream_);
  std::lock_guard<std::mutex> lock(mu_);
  if (rc != cudaSuccess) {
    spare_.push_back(e);
    DDP_CUDA_CHECK(rc);
  }
  marks_.push_back(Mark{e, unmarked_, has_unmarked_, tag, done});
  has_unmarked_ = false;
  return true;
}

// The newest mark of `tag` is this iteration's (a bucket's tag is its index, the same every
// iteration); one no longer held has completed. The wait captures the event's state when enqueued,
// so a later reuse of the event does not move it.
void CudaStream::user_wait_tag(void* user_stream, int tag) {
  DeviceGuard g(device_);
  refuse_capture(user_stream, "ddp_wait_grad");
  std::lock_guard<std::mutex> lock(mu_);
  for (auto m = marks_.rbegin(); m != marks_.rend(); ++m)
    if (m->tag == tag) {
      DDP_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(user_stream), m->event, 0));
      return;
    }
}

// Once the stream is late, the abort has released its stuck work, whose marks then complete: the
// bucket to name is the one found late, not the oldest mark still pending.
int CudaStream::oldest_unfinished() {
  std::lock_guard<std::mutex> lock(mu_);
  if (late_) return late_tag_;
  late_locked(false);
  return marks_.empty() ? -1 : marks_.front().tag;
}

// Sets late_tag_ to the bucket of the late work (-1: work enqueued after the last mark).
bool CudaStream::late_locked(bool stream_idle) {
  if (late_) return true;  // aborted work completing is not a bucket done
  while (!marks_.empty() && (stream_idle || cudaEventQuery(marks_.front().event) == cudaSuccess)) {
    marks_.front().done->fetch_add(1, std::memory_order_relaxed);
    spare_.push_back(marks_.front().event);
    marks_.pop_front();
  }
  if (stream_idle) has_unmarked_ = false;
  for (const Mark& m : marks_)
    if (m.has_deadline && m.deadline.passed()) {
      late_tag_ = marks_.front().tag;  // the oldest unfinished: work before a late mark is stuck too
      return true;
    }
  late_tag_ = marks_.empty() ? -1 : marks_.front().tag;
  return has_unmarked_ && unmarked_.passed() && cudaStreamQuery(stream_) == cudaErrorNotReady;
}

// The watchdog's check. Aborting releases the stuck kernels (and whoever waits on them); the sources
// abort every communicator split from the same parent at once, so none waits on a sibling's kernel.
void CudaStream::scan() {
  std::vector<AsyncErrorSource*> stuck;
  {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock() || late_ || cancelled_) return;
    DeviceGuard g(device_, true);
    if (!late_locked(false)) return;
    late_ = true;
    abandoned_->store(true);
    stuck = sources_;
  }
  for (AsyncErrorSource* s : stuck) s->mark_stalled();
}

void CudaStream::fail_late() {
  std::string who;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (AsyncErrorSource* s : sources_)
      if (who.empty()) who = s->who();
  }
  fail(DDP_ERR_TIMEOUT,
       "stream %d%s%s: a collective did not complete before the timeout: another rank stalled, died or issued a "
       "different collective; its communicators were aborted",
       index_, who.empty() ? "" : ", ", who.c_str());
}

bool CudaStream::idle() {
  std::vector<AsyncErrorSource*> srcs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    srcs = sources_;
  }
  if (late()) fail_late();
  for (AsyncErrorSource* s : srcs) s->check_async();
  // Querying a stream that is being captured into a graph would invalidate the capture.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DDP_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
  if (capture != cudaStreamCaptureStatusNone) return true;
  cudaError_t rc = cudaStreamQuery(stream_);
  if (rc == cudaSuccess) {
    // A collective that failed may have finished after the check above: its error must not be
    // mistaken for a clean finish (the grads it left are not reduced).
    for (AsyncErrorSource* s : srcs) s->check_async();
    std::lock_guard<std::mutex> lock(mu_);
    late_locked(true);
    return true;
  }
  if (rc != cudaErrorNotReady) DDP_CUDA_CHECK(rc);
  bool over = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    over = !late_ && late_locked(false);
    if (over) late_ = true, abandoned_->store(true);
  }
  if (over) {
    for (AsyncErrorSource* s : srcs) s->mark_stalled();
    fail_late();
  }
  return false;
}

bool CudaStream::late() {
  std::lock_guard<std::mutex> lock(mu_);
  return late_;
}

// Host waits for one event of this stream; the stream's own checks bound the wait.
void CudaStream::wait_event(cudaEvent_t e) {
  for (unsigned spin = 0;; ++spin) {
    const cudaError_t rc = cudaEventQuery(e);
    if (rc == cudaSuccess) return;
    if (rc != cudaErrorNotReady) DDP_CUDA_CHECK(rc);
    if (idle()) return;
    if (spin < 64)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void CudaStream::poll_error() {
  DeviceGuard g(device_);
  idle();
}

void CudaStream::drain(Deadline deadline) {
  DeviceGuard g(device_);
  const Deadline warn_at = Deadline::after_ms(stall_ms_);
  bool warned = stall_ms_ <= 0 || !stall_warn_;
  const bool watching = peer_ms_ > 0 && peer_check_;
  Deadline ask_at = Deadline::after_ms(peer_ms_);
  for (unsigned spin = 0; !idle(); ++spin) {
    if (deadline.passed()) fail(DDP_ERR_TIMEOUT, "stream %d: work still running at the deadline", index_);
    if (!warned && warn_at.passed()) {
      warned = true;
      stall_warn_();
    }
    if (watching && ask_at.passed()) {
      peer_check_();
      ask_at = Deadline::after_ms(peer_ms_);
    }
    if (spin < 64)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace ddp
