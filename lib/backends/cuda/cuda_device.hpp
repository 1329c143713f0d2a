// The CUDA device: device memory, CUDA streams and events, the bucket kernels. Knows nothing of
// buckets or plans: it packs and unpacks segment tables and orders streams as the reducer asks.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "core/backend.hpp"

namespace ddp {

// One macro for every CUDA runtime return code: a failure throws DDP_ERR_CUDA (an allocation failure
// DDP_ERR_OUT_OF_MEMORY) naming the call and CUDA's error.
[[noreturn]] void cuda_fail(cudaError_t rc, const char* call, const char* file, int line);
#define DDP_CUDA_CHECK(call)                                                                    \
  do {                                                                                          \
    cudaError_t ddp_cuda_rc_ = (call);                                                          \
    if (ddp_cuda_rc_ != cudaSuccess) ::ddp::cuda_fail(ddp_cuda_rc_, #call, __FILE__, __LINE__); \
  } while (0)

// Throws DDP_ERR_CUDA naming the cause when no CUDA device is usable (no driver, no device, or
// CUDA_VISIBLE_DEVICES hides them all), DDP_ERR_INVALID_ARGUMENT when `device` is out of range.
// device < 0 only checks that some device exists. Returns the number of devices.
int require_cuda_device(int device);

// Makes `device` current for its lifetime and restores the caller's state after: its current device,
// or, on a thread where no CUDA context was current (it never set a device), no context again, so
// that the library never creates a context on GPU 0 behind the caller's back. The quiet form (for
// destructors) reports nothing when the switch fails.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  DeviceGuard(int device, bool quiet);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  int device_;
  bool had_context_ = true;
};

// Throws DDP_ERR_UNSUPPORTED when `user_stream` is being captured into a CUDA graph: an iteration
// keeps host-side state (deadlines, flags, statistics) that a replayed graph would not update.
void refuse_capture(void* user_stream, const char* where);

// Something whose enqueued GPU work the watchdog checks against deadlines, from its own thread.
class Watched {
 public:
  virtual ~Watched() = default;
  // Called by the watchdog thread every few milliseconds: aborts what is late.
  virtual void scan() = 0;
};
// The process's watchdog thread (started on first use): scans every registered item until it is
// unregistered; unregister returns once no scan of it runs.
void watchdog_register(Watched* w);
void watchdog_unregister(Watched* w);

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

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int device);
  ~CudaDevice() override;
  // Device memory, and CUDA streams of this device.
  Memory memory() const override { return Memory::Device; }
  void* alloc(size_t bytes) override;
  void free(void* p) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  std::unique_ptr<Stream> make_stream(int index) override;
  // Ordering with the user's stream: CUDA events, no host wait.
  void stream_wait_user(Stream& s, void* user_stream) override;
  void check_user_stream(void* user_stream) override { refuse_capture(user_stream, "ddp_begin_backward"); }
  void user_wait_stream(void* user_stream, Stream& s) override;
  // Element work, enqueued on `s`: a batched copy or one multi-tensor launch, over whole buckets only.
  void pack(SegmentTable& table, Dtype src, void* dst, Dtype wire, double scale, Span span, Stream& s) override;
  void unpack(const void* src, Dtype wire, SegmentTable& table, Dtype dst, double scale, Span span, Stream& s) override;
  void scale(void* buf, size_t n, Dtype d, double scale, Stream& s) override;
  void fill_zero(void* buf, size_t n, Dtype d, Stream& s) override;
  // Finiteness flags live on the device: scans are kernels; take_nonfinite copies a flag back and waits.
  void reserve_flags(size_t slots) override;
  void scan_nonfinite(const void* buf, size_t n, Dtype d, size_t slot, Stream& s) override;
  bool take_nonfinite(size_t slot, Stream& s) override;
  // The norm: one kernel writes per-block partials, summed on the host in block order.
  void norm_terms(const void* buf, size_t n, Dtype d, Stream& s, double out[2]) override;
  void int8_quantize(const void* x, Dtype d, size_t n, float* residual, void* chunk, Stream& s) override;
  void int8_dequant_sum(const void* chunks, size_t chunk_bytes, int world, size_t n, Dtype d, void* out,
                        Stream& s) override;
  // One CUDA event per slot.
  void reserve_marks(size_t slots) override;
  void mark(size_t slot, Stream& s) override;
  void user_wait_mark(void* user_stream, size_t slot) override;

  // Times the tables were uploaded to the device (tests check that steady state uploads nothing).
  uint64_t uploads() const { return uploads_; }

 private:
  struct TableState;
  TableState& prepare(SegmentTable& table, const void* flat, size_t flat_elem, CudaStream& s);
  void check_pointers(const SegmentTable& table) const;
  CudaStream& cuda(Stream& s) const;
  // Zeroes new device memory on the device's own stream and waits for it, so that the zeros land
  // before the buffer is handed out (a memset on the legacy stream is not ordered with the
  // non-blocking streams that write the buffer next).
  void zero_new(void* p, size_t bytes);
  // Whether work of one of this device's streams was written off (see CudaStream::abandoned).
  bool abandoned() const;

  int device_;
  cudaStream_t setup_ = nullptr;                               // a non-blocking stream for zeroing new buffers
  std::vector<std::shared_ptr<std::atomic<bool>>> abandoned_;  // one per stream made
  unsigned* dev_flags_ = nullptr;                              // one finiteness flag per slot, on the device
  size_t nflags_ = 0;
  unsigned* host_flag_ = nullptr;  // a pinned host copy of one of them
  uint64_t uploads_ = 0;
  double* dev_partials_ = nullptr;   // the norm kernel's per-block partials
  double* host_partials_ = nullptr;  // their pinned host copy
  std::vector<cudaEvent_t> marks_;
};

}  // namespace ddp
