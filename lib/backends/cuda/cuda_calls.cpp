// Calling the CUDA runtime: the check of its return codes, whether a device is usable, the device
// guard (which must tell "no context on this thread" from "device 0", through the driver), and the
// refusal of streams under graph capture.
#include "backends/cuda/cuda_calls.hpp"

#include <cstring>

namespace ddp {

void cuda_fail(cudaError_t rc, const char* call, const char* file, int line) {
  cudaGetLastError();  // clear a non-sticky error so that later calls do not see it again
  const char* base = std::strrchr(file, '/');
  fail(rc == cudaErrorMemoryAllocation ? DDP_ERR_OUT_OF_MEMORY : DDP_ERR_CUDA, "%s failed: %s (%s) at %s:%d", call,
       cudaGetErrorName(rc), cudaGetErrorString(rc), base ? base + 1 : file, line);
}

int require_cuda_device(int device) {
  int n = 0;
  cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    const char* why = rc == cudaErrorNoDevice ? "no CUDA device is visible to this process"
                      : rc == cudaErrorInsufficientDriver
                          ? "no usable CUDA driver, so no CUDA device (no GPU driver is installed, or it is older "
                            "than the CUDA runtime libddp was built with)"
                          : "no CUDA device is usable";
    fail(DDP_ERR_CUDA, "%s: cudaGetDeviceCount failed with %s (%s)", why, cudaGetErrorName(rc), cudaGetErrorString(rc));
  }
  if (n <= 0) fail(DDP_ERR_CUDA, "no CUDA device is visible to this process (cudaGetDeviceCount found 0)");
  if (device >= n)
    fail(DDP_ERR_INVALID_ARGUMENT, "CUDA device %d does not exist: %d device%s visible (0..%d)", device, n,
         n == 1 ? " is" : "s are", n - 1);
  return n;
}

namespace {

// The driver's current-context calls, found through the runtime (no link to libcuda): the runtime
// alone cannot tell "device 0 is current" from "nothing was ever made current on this thread".
struct CtxApi {
  int (*get)(void** ctx) = nullptr;
  int (*set)(void* ctx) = nullptr;
};

const CtxApi& ctx_api() {
  static const CtxApi a = [] {
    CtxApi x;
    const cudaError_t before = cudaPeekAtLastError();
    void *get = nullptr, *set = nullptr;
    cudaDriverEntryPointQueryResult qg = cudaDriverEntryPointSymbolNotFound, qs = qg;
    const bool ok =
        cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 12000, cudaEnableDefault, &qg) == cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 12000, cudaEnableDefault, &qs) == cudaSuccess &&
        qg == cudaDriverEntryPointSuccess && qs == cudaDriverEntryPointSuccess;
    if (ok) {
      x.get = reinterpret_cast<int (*)(void**)>(get);
      x.set = reinterpret_cast<int (*)(void*)>(set);
    } else if (before == cudaSuccess) {
      cudaGetLastError();  // our failed lookup only: a pending error of the caller's stays
    }
    return x;
  }();
  return a;
}

}  // namespace

DeviceGuard::DeviceGuard(int device) : device_(device) {
  void* ctx = nullptr;
  if (ctx_api().get && ctx_api().get(&ctx) == 0) had_context_ = ctx != nullptr;
  DDP_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device_ || !had_context_) DDP_CUDA_CHECK(cudaSetDevice(device_));
}

DeviceGuard::DeviceGuard(int device, bool) : device_(device) {
  void* ctx = nullptr;
  if (ctx_api().get && ctx_api().get(&ctx) == 0) had_context_ = ctx != nullptr;
  if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
  if (prev_ != device_ || !had_context_) cudaSetDevice(device_);
}

DeviceGuard::~DeviceGuard() {
  // A destructor cannot throw, and there is nothing to undo if the switch back fails.
  if (!had_context_)
    ctx_api().set(nullptr);  // as the caller had it: no context, none created on GPU 0
  else if (prev_ >= 0 && prev_ != device_)
    cudaSetDevice(prev_);
}

void refuse_capture(void* user_stream, const char* where) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DDP_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(user_stream), &capture));
  if (capture != cudaStreamCaptureStatusNone)
    fail(DDP_ERR_UNSUPPORTED,
         "%s: the stream is being captured into a CUDA graph, and libddp cannot be captured: an iteration keeps "
         "state on the host (deadlines, finiteness flags, statistics) that a replayed graph would not update. "
         "Call libddp outside the captured region",
         where);
}

}  // namespace ddp
