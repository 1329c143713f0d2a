// Calling the CUDA runtime: the check of its return codes, whether a device is usable, making a
// device current for a scope (and restoring the caller's state after), and the refusal of a stream
// being captured into a CUDA graph. Every file of the CUDA backend uses them.
#pragma once

#include <cuda_runtime_api.h>

#include "core/common.hpp"

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

}  // namespace ddp
