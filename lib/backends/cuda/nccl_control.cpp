// The NCCL communicator's control path (agreement, plan, unused-grad report): small host messages,
// over the host communicator when it can regroup (Gloo), else staged through device memory on the
// communicator's own stream and waited for by polling against the deadline.
#include "backends/cuda/nccl_comm.hpp"

#include <cstring>

namespace ddp {
namespace nccl {

// Through the host communicator this one was made over (MPI or Gloo); without one, nothing can be
// asked.
std::unique_ptr<Prober> NcclComm::make_prober(std::function<Position()> mine) {
  return host_ ? host_->make_prober(std::move(mine)) : nullptr;
}

// Whether the control path runs over the host communicator (Gloo, which bounds its own waits and
// fails at once when a peer's connection closes: an elastic job learns of a death there without
// waiting for its timeout) rather than through device memory. Not over MPI, whose blocking calls
// would wait for a dead peer forever.
bool NcclComm::host_control() const { return host_ && host_->can_regroup(); }

void NcclComm::allgather_host(const void* in, void* out, size_t bytes, Deadline dl) {
  if (!comm_ && host_ && !aborted_) {  // a membership agreed on, its NCCL communicator not made yet
    host_->allgather_host(in, out, bytes, dl);
    wire_bytes()->allgather(bytes, size_);
    return;
  }
  live();
  if (host_control()) {
    host_->allgather_host(in, out, bytes, dl);
    wire_bytes()->allgather(bytes, size_);
    return;
  }
  DeviceGuard g(device_);
  const size_t total = bytes * (static_cast<size_t>(size_) + 1);
  char* d = ctrl_buffer(total);
  std::memcpy(ctrl_host_, in, bytes);
  DDP_CUDA_CHECK(cudaMemcpyAsync(d, ctrl_host_, bytes, cudaMemcpyHostToDevice, ctrl_stream_));
  {
    std::unique_lock<std::mutex> lock = hold();
    DDP_NCCL_RUN(ncclAllGather(d, d + bytes, bytes, ncclUint8, comm_, ctrl_stream_), comm_, dl);
  }
  DDP_CUDA_CHECK(cudaMemcpyAsync(ctrl_host_ + bytes, d + bytes, total - bytes, cudaMemcpyDeviceToHost, ctrl_stream_));
  wait_ctrl(dl, "NCCL allgather (control path)");
  wire_bytes()->allgather(bytes, size_);
  std::memcpy(out, ctrl_host_ + bytes, total - bytes);
}

void NcclComm::broadcast_host(void* buf, size_t bytes, int root, Deadline dl) {
  live();
  if (root < 0 || root >= size_)
    fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size_ - 1);
  if (bytes == 0) return;
  if (host_control()) {
    host_->broadcast_host(buf, bytes, root, dl);
    wire_bytes()->broadcast(bytes, size_, rank_, root);
    return;
  }
  DeviceGuard g(device_);
  char* d = ctrl_buffer(bytes);
  if (rank_ == root) {
    std::memcpy(ctrl_host_, buf, bytes);
    DDP_CUDA_CHECK(cudaMemcpyAsync(d, ctrl_host_, bytes, cudaMemcpyHostToDevice, ctrl_stream_));
  }
  {
    std::unique_lock<std::mutex> lock = hold();
    DDP_NCCL_RUN(ncclBroadcast(d, d, bytes, ncclUint8, root, comm_, ctrl_stream_), comm_, dl);
  }
  DDP_CUDA_CHECK(cudaMemcpyAsync(ctrl_host_, d, bytes, cudaMemcpyDeviceToHost, ctrl_stream_));
  wait_ctrl(dl, "NCCL broadcast (control path)");
  wire_bytes()->broadcast(bytes, size_, rank_, root);
  std::memcpy(buf, ctrl_host_, bytes);
}

// Device memory and its pinned host twin: results come back on the control stream, whose own
// wait keeps the deadline (a blocking copy on the legacy stream would wait for the user's
// blocking streams too, with no deadline).
char* NcclComm::ctrl_buffer(size_t bytes) {
  if (!ctrl_stream_) DDP_CUDA_CHECK(cudaStreamCreateWithFlags(&ctrl_stream_, cudaStreamNonBlocking));
  if (bytes > ctrl_bytes_) {
    cudaFree(ctrl_buf_);  // the previous control call was waited for: nothing uses them
    cudaFreeHost(ctrl_host_);
    ctrl_buf_ = nullptr;
    ctrl_host_ = nullptr;
    ctrl_bytes_ = 0;
    DDP_CUDA_CHECK(cudaMalloc(&ctrl_buf_, bytes));
    DDP_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&ctrl_host_), bytes));
    ctrl_bytes_ = bytes;
  }
  return static_cast<char*>(ctrl_buf_);
}

void NcclComm::wait_ctrl(Deadline dl, const char* what) {
  for (unsigned spin = 0;; ++spin) {
    cudaError_t rc = cudaStreamQuery(ctrl_stream_);
    if (rc == cudaSuccess && aborted_) live();  // it ended because it was aborted: its bytes are not results
    if (rc == cudaSuccess) return;
    if (rc != cudaErrorNotReady) DDP_CUDA_CHECK(rc);
    check_async();
    if (aborted_) {
      live();  // a timeout elsewhere in the context says so
      fail(DDP_ERR_ABORTED, "%s: the NCCL communicator was aborted while it ran", what);
    }
    if (dl.passed()) {
      mark_stalled();
      fail(DDP_ERR_TIMEOUT,
           "%s did not complete before the timeout: another rank stalled, died or issued a "
           "different collective",
           what);
    }
    backoff(spin);
  }
}

}  // namespace nccl
}  // namespace ddp
