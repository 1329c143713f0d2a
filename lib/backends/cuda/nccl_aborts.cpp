// The NCCL communicator's aborts: of a family of communicators at once, on an asynchronous error
// (checked by the bucket streams' polls), on a stall found by the watchdog, or to sever the job's
// connections; and the watchdog's check of broadcasts on the user's stream.
#include "backends/cuda/nccl_comm.hpp"

#include <thread>

namespace ddp {
namespace nccl {

// Held throughout: a member cannot leave (be destroyed) while it is being aborted.
void Family::abort_all() {
  std::lock_guard<std::mutex> lock(mu);
  std::vector<std::thread> threads;
  for (NcclComm* c : members) threads.emplace_back([c] { c->abort_one(); });
  for (std::thread& t : threads) t.join();
}

void NcclComm::abort() {
  if (member_)
    family_->abort_all();
  else
    abort_one();
}

void NcclComm::abort_one() {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_) return;
  aborted_ = true;
  stalled_ = true;  // nothing may wait on this communicator any more
  if (owned_ && comm_) {
    DeviceGuard g(device_, true);
    ncclCommAbort(comm_);
  }
}

void NcclComm::check_async() {
  if (!comm_) return;  // not made yet: nothing runs on it
  if (severed_ || (member_ && family_->severed))
    fail(DDP_ERR_ABORTED,
         "rank %d of %d: the NCCL communicators were closed because a peer was lost: the collectives they ran "
         "did not complete",
         rank_, size_);
  std::string text;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;
    ncclResult_t async = ncclSuccess;
    DDP_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async), comm_);
    if (async == ncclSuccess || async == ncclInProgress) return;
    text = format("NCCL reported an asynchronous error (rank %d of %d): %s%s%s", rank_, size_,
                  ncclGetErrorString(async), nccl_last_error(comm_)[0] ? ": " : "", nccl_last_error(comm_));
  }
  stalled_ = true;
  abort();  // NCCL's rule: a communicator with an asynchronous error is aborted
  throw Error(DDP_ERR_NCCL, text);
}
// A collective of this communicator is stuck: abort now, so that nothing (a later cudaFree, the
// context's teardown) waits on its kernels forever.
void NcclComm::mark_stalled() {
  stalled_ = true;
  late_ = true;
  if (member_) family_->late = true;
  abort();
}

// The watchdog's check of ddp_broadcast (enqueued on the user's stream, which no libddp call
// polls): past its deadline, the communicators are aborted and the next broadcast says why.
void NcclComm::scan() {
  bool late = false;
  {
    std::unique_lock<std::mutex> lock(bcast_mu_, std::try_to_lock);
    if (!lock.owns_lock() || bcast_pending_.empty()) return;
    DeviceGuard g(device_, true);
    while (!bcast_pending_.empty() && cudaEventQuery(bcast_pending_.front().first) == cudaSuccess) {
      bcast_events_.push_back(bcast_pending_.front().first);
      bcast_pending_.pop_front();
    }
    late = !bcast_pending_.empty() && bcast_pending_.front().second.passed();
    if (late) bcast_late_ = true, bcast_pending_.clear();
  }
  if (late) mark_stalled();
}

// A broadcast on the user's stream: an event after it, checked by the watchdog against `dl`.
void NcclComm::watch_broadcast(cudaStream_t us, Deadline dl) {
  if (dl.infinite()) return;
  std::lock_guard<std::mutex> lock(bcast_mu_);
  cudaEvent_t e = nullptr;
  if (!bcast_events_.empty()) {
    e = bcast_events_.back();
    bcast_events_.pop_back();
  } else {
    DDP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  const cudaError_t rc = cudaEventRecord(e, us);
  if (rc != cudaSuccess) bcast_events_.push_back(e);
  DDP_CUDA_CHECK(rc);
  bcast_pending_.emplace_back(e, dl);
}

}  // namespace nccl
}  // namespace ddp
