// The CUDA device: device memory, CUDA streams and events, the bucket kernels. Knows nothing of
// buckets or plans: it packs and unpacks segment tables and orders streams as the reducer asks. Its
// parts: memory, copies and stream ordering (cuda_device.cpp), the kernels' launches
// (cuda_launches.cpp), segment tables on the device (device_tables.*), the bucket streams
// (cuda_stream.*) and the watchdog that checks them (watchdog.*).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <memory>
#include <vector>

#include "backends/cuda/cuda_calls.hpp"
#include "backends/cuda/cuda_stream.hpp"
#include "core/backend.hpp"

namespace ddp {

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
