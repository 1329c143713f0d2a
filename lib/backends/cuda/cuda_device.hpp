// The CUDA device: device memory, CUDA streams and events, the bucket kernels. Knows nothing of
// buckets or plans: it packs and unpacks segment tables and orders streams as the reducer asks.
#pragma once

#include <cuda_runtime_api.h>

#include <exception>
#include <functional>
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

// Makes `device` current for its lifetime and restores the caller's current device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  int device_;
};

// A bucket stream: a non-blocking CUDA stream. Tasks run on the submitting thread and only enqueue.
class CudaStream final : public Stream {
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

  cudaStream_t stream() const { return stream_; }
  // The user's stream -> this stream, and back (one event each, reused: recording again is safe
  // because waits capture the event's state when they are enqueued).
  cudaEvent_t in_event() const { return in_event_; }
  cudaEvent_t out_event() const { return out_event_; }
  void watch(AsyncErrorSource* src, Deadline dl) override;

 private:
  // True when every enqueued operation has finished. Throws on a CUDA error, an asynchronous error
  // of a watched source, or a collective past its deadline.
  bool idle();

  int device_, index_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t in_event_ = nullptr, out_event_ = nullptr;
  bool cancelled_ = false;
  std::vector<AsyncErrorSource*> sources_;
  Deadline pending_;  // the latest deadline of enqueued collectives
  bool has_pending_ = false;
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

  int device_;
  unsigned* dev_flags_ = nullptr;  // one finiteness flag per slot, on the device
  size_t nflags_ = 0;
  unsigned* host_flag_ = nullptr;  // a pinned host copy of one of them
  uint64_t uploads_ = 0;
  double* dev_partials_ = nullptr;   // the norm kernel's per-block partials
  double* host_partials_ = nullptr;  // their pinned host copy
  std::vector<cudaEvent_t> marks_;
};

}  // namespace ddp
