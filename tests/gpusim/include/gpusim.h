// What the simulated CUDA runtime offers the other simulated pieces (the kernels, NCCL) and the
// tests that drive the simulation: enqueueing work on a stream, asking what memory a pointer is, a
// device fault, and an injected NCCL asynchronous error. Tests only.
#pragma once

#include <stddef.h>

#include <functional>

#include "cuda_runtime_api.h"
#include "nccl.h"

extern "C++" {
namespace gpusim {

// Enqueues `op` on `stream` (null or cudaStreamLegacy: the current device's legacy stream); the
// stream's thread runs it in order, after a random delay. Returns cudaErrorInvalidResourceHandle
// for a stream that does not exist.
cudaError_t enqueue(cudaStream_t stream, std::function<void()> op);
// The device a stream belongs to (-1: no such stream).
int stream_device(cudaStream_t stream);
// Whether [p, p + bytes) lies inside one device allocation (on *device, if given).
bool device_range(const void* p, size_t bytes, int* device = nullptr);
// A kernel touched memory it may not: the device's context is broken from now on (sticky
// cudaErrorIllegalAddress), as after a fault on a real GPU; `what` is printed to stderr.
void fault(int device, const char* what);
// The current device of the calling thread.
int current_device();
// Whether a CUDA context is current on the calling thread: false on a thread that never set a device
// nor used the runtime (the first runtime call that needs one makes device 0's primary context
// current, as the real runtime does), and after cuCtxSetCurrent(NULL).
bool thread_has_context();
// Makes cudaStreamIsCapturing report `stream` as being captured (true) or not, for tests.
void set_capturing(cudaStream_t stream, bool capturing);
// How many ncclCommSplit calls were made, and how many of them shared their parent's resources
// (ncclConfig_t.splitShare = 1), since the process started.
void nccl_split_counts(int* splits, int* shared);

// Makes ncclCommGetAsyncError report `error` for `comm` from now on (tests of the error path).
void nccl_inject_async_error(ncclComm_t comm, ncclResult_t error);
// Fault injection for every communicator of the process, present and future: `error` != ncclSuccess
// makes each collective fail with it when it runs (ncclCommGetAsyncError reports it after); `stall`
// makes each collective wait, as for a peer that never arrives, until its communicator is aborted.
void nccl_fail_collectives(ncclResult_t error);
void nccl_stall_collectives(bool stall);

}  // namespace gpusim
}
