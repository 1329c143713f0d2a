// The CUDA device's memory (zeroed on its own stream, kept when work was written off), copies, the
// ordering of its bucket streams with the user's stream, and the events that mark a bucket's end.
#include "backends/cuda/cuda_device.hpp"

namespace ddp {

CudaDevice::CudaDevice(int device) : device_(device) {
  require_cuda_device(device_);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_flag_), sizeof(unsigned)));
  DDP_CUDA_CHECK(cudaStreamCreateWithFlags(&setup_, cudaStreamNonBlocking));
}

CudaDevice::~CudaDevice() {
  DeviceGuard g(device_, true);
  if (!abandoned()) {  // else a kernel that never finishes may still write them: kept
    cudaFree(dev_flags_);
    cudaFreeHost(host_flag_);
    cudaFree(dev_partials_);
    cudaFreeHost(host_partials_);
  }
  for (cudaEvent_t e : marks_) cudaEventDestroy(e);
  if (setup_) cudaStreamDestroy(setup_);
}

bool CudaDevice::abandoned() const {
  for (const auto& a : abandoned_)
    if (a->load()) return true;
  return false;
}

void CudaDevice::zero_new(void* p, size_t bytes) {
  DDP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, setup_));
  DDP_CUDA_CHECK(cudaStreamSynchronize(setup_));  // only this memset is queued there: no deadline needed
}

void* CudaDevice::alloc(size_t bytes) {
  DeviceGuard g(device_);
  void* p = nullptr;
  cudaError_t rc = cudaMalloc(&p, bytes ? bytes : 1);
  if (rc == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    fail(DDP_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes on CUDA device %d", bytes, device_);
  }
  DDP_CUDA_CHECK(rc);
  try {
    zero_new(p, bytes ? bytes : 1);
  } catch (...) {
    cudaFree(p);
    throw;
  }
  return p;
}

void CudaDevice::free(void* p) {
  if (!p) return;
  // After a stream wrote work off, a kernel that never finishes may still write the buffer, and the
  // wait below would last forever (a borrowed communicator is never aborted by libddp): kept.
  if (abandoned()) return;
  DeviceGuard g(device_, true);
  // Work queued on any stream may still use the buffer: wait for it (frees happen only when a plan is
  // adopted or a context is destroyed). Failures cannot be reported from here.
  cudaDeviceSynchronize();
  cudaFree(p);
}

void CudaDevice::copy(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  DeviceGuard g(device_);
  // Called when the arena moves: the user's streams may still be writing the old storage, and the
  // copy must see their results, so the whole device is synchronized first (once per layout change).
  DDP_CUDA_CHECK(cudaDeviceSynchronize());
  DDP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
  DDP_CUDA_CHECK(cudaDeviceSynchronize());
}

std::unique_ptr<Stream> CudaDevice::make_stream(int index) {
  std::unique_ptr<CudaStream> s(new CudaStream(device_, index));
  abandoned_.push_back(s->abandoned());
  return std::unique_ptr<Stream>(s.release());
}

void CudaDevice::stream_wait_user(Stream& s, void* user_stream) {
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  refuse_capture(user_stream, "ddp_grad_ready");
  DDP_CUDA_CHECK(cudaEventRecord(c.in_event(), static_cast<cudaStream_t>(user_stream)));
  DDP_CUDA_CHECK(cudaStreamWaitEvent(c.stream(), c.in_event(), 0));
}

void CudaDevice::user_wait_stream(void* user_stream, Stream& s) {
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  refuse_capture(user_stream, "ddp_finish_backward");
  DDP_CUDA_CHECK(cudaEventRecord(c.out_event(), c.stream()));
  DDP_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(user_stream), c.out_event(), 0));
}

CudaStream& CudaDevice::cuda(Stream& s) const {
  CudaStream* c = dynamic_cast<CudaStream*>(&s);
  if (!c) fail(DDP_ERR_INTERNAL, "the CUDA device was given a stream it did not make");
  return *c;
}

void CudaDevice::reserve_marks(size_t slots) {
  DeviceGuard g(device_);
  while (marks_.size() < slots) {
    cudaEvent_t e = nullptr;
    DDP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    marks_.push_back(e);
  }
}

void CudaDevice::mark(size_t slot, Stream& s) {
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaEventRecord(marks_.at(slot), cuda(s).stream()));
}

void CudaDevice::user_wait_mark(void* user_stream, size_t slot) {
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(user_stream), marks_.at(slot), 0));
}

}  // namespace ddp
