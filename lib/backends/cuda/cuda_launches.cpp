// The CUDA device's element work: each call enqueues kernels (or CUB's batched copy) on a bucket
// stream and returns; only the finiteness flag and the norm's partials are waited for.
#include "backends/cuda/device_tables.hpp"
#include "kernels/multi_tensor.h"

namespace ddp {

// Whether the calling thread holds a CUDA error nobody has read yet (the caller's, or a sticky one).
// CUB's batched copy would answer it as its own result (it checks its launch with
// cudaPeekAtLastError): the multi-tensor kernel, whose launch reports its own result, copies instead
// (a scale of 1 is a plain copy, bit for bit), and the error stays the caller's.
static bool error_pending() { return cudaPeekAtLastError() != cudaSuccess; }

// The GPU path reduces a bucket whole (NCCL cuts no pieces): a span is always the whole table.
static void require_whole(const SegmentTable& table, Span span) {
  const Segment& last = table.segs.back();
  if (span.lo != 0 || span.hi < last.offset + last.numel)
    fail(DDP_ERR_INTERNAL, "cuda device: pack/unpack of a part of a bucket");
}

void CudaDevice::pack(SegmentTable& table, Dtype src, void* dst, Dtype wire, double scale, Span span, Stream& s) {
  if (table.segs.empty()) return;
  require_whole(table, span);
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  TableState& st = prepare(table, dst, dtype_size(wire), c);
  if (src == wire && scale == 1.0 && !st.any_zero && !error_pending()) {
    size_t temp = st.temp_bytes;
    DDP_CUDA_CHECK(
        kern::batched_copy(st.temp, &temp, st.grads(), st.flats(), st.bytes(), static_cast<int>(st.n), c.stream()));
  } else {
    DDP_CUDA_CHECK(kern::launch_multi_tensor(st.segs(), static_cast<int>(st.n), st.total_blocks,
                                             static_cast<ddp_dtype_t>(src), static_cast<ddp_dtype_t>(wire), dst, 1,
                                             scale, c.stream()));
  }
}

void CudaDevice::unpack(const void* src, Dtype wire, SegmentTable& table, Dtype dst, double scale, Span span,
                        Stream& s) {
  if (table.segs.empty()) return;
  require_whole(table, span);
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  TableState& st = prepare(table, src, dtype_size(wire), c);
  if (wire == dst && scale == 1.0 && !error_pending()) {
    size_t temp = st.temp_bytes;
    DDP_CUDA_CHECK(
        kern::batched_copy(st.temp, &temp, st.flats(), st.grads(), st.bytes(), static_cast<int>(st.n), c.stream()));
  } else {
    DDP_CUDA_CHECK(kern::launch_multi_tensor(st.segs(), static_cast<int>(st.n), st.total_blocks,
                                             static_cast<ddp_dtype_t>(wire), static_cast<ddp_dtype_t>(dst),
                                             const_cast<void*>(src), 0, scale, c.stream()));
  }
}

void CudaDevice::scale(void* buf, size_t n, Dtype d, double scale, Stream& s) {
  if (scale == 1.0 || n == 0) return;
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(kern::launch_scale(buf, n, static_cast<ddp_dtype_t>(d), scale, c.stream()));
}

void CudaDevice::fill_zero(void* buf, size_t n, Dtype d, Stream& s) {
  if (n == 0) return;
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaMemsetAsync(buf, 0, n * dtype_size(d), c.stream()));
}

void CudaDevice::int8_quantize(const void* x, Dtype d, size_t n, float* residual, void* chunk, Stream& s) {
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(kern::launch_int8_quantize(x, static_cast<ddp_dtype_t>(d), n, residual, chunk, c.stream()));
}

void CudaDevice::int8_dequant_sum(const void* chunks, size_t chunk_bytes, int world, size_t n, Dtype d, void* out,
                                  Stream& s) {
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(
      kern::launch_int8_dequant(chunks, chunk_bytes, world, n, static_cast<ddp_dtype_t>(d), out, c.stream()));
}

void CudaDevice::reserve_flags(size_t slots) {
  if (slots <= nflags_) return;
  DeviceGuard g(device_);
  unsigned* fresh = nullptr;
  DDP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&fresh), slots * sizeof(unsigned)));
  try {
    zero_new(fresh, slots * sizeof(unsigned));
  } catch (...) {
    cudaFree(fresh);
    throw;
  }
  cudaFree(dev_flags_);
  dev_flags_ = fresh;
  nflags_ = slots;
}

// The kernel only ever sets its flag, so scans of one bucket accumulate; nothing waits here.
void CudaDevice::scan_nonfinite(const void* buf, size_t n, Dtype d, size_t slot, Stream& s) {
  if (n == 0) return;
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(kern::launch_nonfinite(buf, n, static_cast<ddp_dtype_t>(d), dev_flags_ + slot, c.stream()));
}

bool CudaDevice::take_nonfinite(size_t slot, Stream& s) {
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaMemcpyAsync(host_flag_, dev_flags_ + slot, sizeof(unsigned), cudaMemcpyDeviceToHost, c.stream()));
  DDP_CUDA_CHECK(cudaMemsetAsync(dev_flags_ + slot, 0, sizeof(unsigned), c.stream()));
  c.drain(Deadline::never());  // bounded by the deadlines of the collectives queued before
  return *host_flag_ != 0;
}

void CudaDevice::norm_terms(const void* buf, size_t n, Dtype d, Stream& s, double out[2]) {
  if (n == 0) return;
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  if (!dev_partials_) {
    DDP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev_partials_), 2 * kern::kNormMaxBlocks * sizeof(double)));
    DDP_CUDA_CHECK(
        cudaMallocHost(reinterpret_cast<void**>(&host_partials_), 2 * kern::kNormMaxBlocks * sizeof(double)));
  }
  unsigned blocks = 0;
  DDP_CUDA_CHECK(kern::launch_norm(buf, n, static_cast<ddp_dtype_t>(d), dev_partials_, &blocks, c.stream()));
  DDP_CUDA_CHECK(
      cudaMemcpyAsync(host_partials_, dev_partials_, 2 * blocks * sizeof(double), cudaMemcpyDeviceToHost, c.stream()));
  c.drain(Deadline::never());  // bounded by the deadlines of the collectives queued before
  for (unsigned b = 0; b < blocks; ++b) {
    out[0] += host_partials_[2 * b];
    out[1] += host_partials_[2 * b + 1];
  }
}

}  // namespace ddp
