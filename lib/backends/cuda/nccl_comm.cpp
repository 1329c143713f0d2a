// The NCCL communicator's creation: from an id (made by NCCL on one rank and carried to the others by
// the caller, or over a host communicator), from a borrowed ncclComm_t, and its duplicates (split
// from it, or made from a fresh id before NCCL 2.18); its end (finalized, else aborted).
#include "backends/cuda/nccl_comm.hpp"

#include <cstring>

#include "backends/cuda/cuda_device.hpp"
#include "core/comms.hpp"

namespace ddp {
namespace nccl {

NcclComm::NcclComm(ncclComm_t c, int device, bool owned, std::unique_ptr<Comm> host, int64_t timeout_ms,
                   std::shared_ptr<Family> family)
    : comm_(c),
      device_(device),
      owned_(owned),
      host_(std::move(host)),
      timeout_ms_(timeout_ms),
      family_(std::move(family)) {
  DDP_NCCL_CHECK(ncclCommUserRank(comm_, &rank_), comm_);
  DDP_NCCL_CHECK(ncclCommCount(comm_, &size_), comm_);
  if (family_) family_->join(this);
  member_ = family_ != nullptr;
  watchdog_register(this);
}

NcclComm::~NcclComm() {
  watchdog_unregister(this);
  if (family_) family_->leave(this);
  DeviceGuard g(device_, true);
  if (!aborted_ && comm_)
    for (auto& op : ops_) api().op_destroy(op.op, comm_);
  if (!aborted_ && owned_ && comm_) {
    if (!finalize())
      ncclCommAbort(comm_);  // a stuck collective would make ncclCommDestroy wait forever
    else
      ncclCommDestroy(comm_);
  }
  for (cudaEvent_t e : bcast_events_) cudaEventDestroy(e);
  if (ctrl_stream_) cudaStreamDestroy(ctrl_stream_);
  if (!stalled_) {  // else a kernel that never finishes may still write them: kept
    cudaFree(ctrl_buf_);
    cudaFreeHost(ctrl_host_);
  }
}

std::unique_ptr<Comm> NcclComm::dup() {
  if (!comm_ && host_ && !aborted_) connect();
  live();
  DeviceGuard g(device_);
  std::unique_ptr<Comm> host = host_ ? host_->dup() : nullptr;
  const Deadline dl = Deadline::after_ms(timeout_ms_);
  ncclComm_t c = nullptr;
  if (api().comm_split) {
    // splitShare: the new communicator shares this one's buffers and proxy instead of allocating
    // its own (a context holds 2 + num_streams of them). Nonblocking, as every call is polled.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.splitShare = 1;
    if (api().init_config) config.blocking = 0;
    ncclResult_t rc = api().comm_split(comm_, 0, rank_, &c, &config);
    if (rc == ncclInProgress && !c) rc = settle(rc, comm_, dl);
    try {
      DDP_NCCL_RUN(rc, c, dl);
    } catch (...) {
      if (c) ncclCommAbort(c);
      throw;
    }
  } else {
    // Before NCCL 2.18: a fresh id from rank 0, sent over this communicator.
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (rank_ == 0) DDP_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
    broadcast_host(&id, sizeof id, 0, dl);
    c = init_rank(id, size_, rank_, timeout_ms_);
  }
  if (!family_) family_ = std::make_shared<Family>();  // the parent is not a member: its owner aborts it
  return std::unique_ptr<Comm>(new NcclComm(c, device_, true, std::move(host), timeout_ms_, family_));
}

std::unique_ptr<Device> NcclComm::make_device() { return std::unique_ptr<Device>(new CudaDevice(device_)); }

bool NcclComm::supports(RedOp op) const {
  switch (op) {
    case RedOp::Sum: return true;
    case RedOp::Avg: return api().version >= 21000;
    case RedOp::PreMulSum: return api().premul_create != nullptr && api().op_destroy != nullptr;
    case RedOp::SumScaled: return false;  // the device's unpack or scale pass applies the factor
  }
  return false;
}

void NcclComm::live() const {
  if (late_ || (member_ && family_->late))
    fail(DDP_ERR_TIMEOUT,
         "rank %d of %d: a collective did not complete before the timeout (another rank stalled, died or issued a "
         "different collective): the context's NCCL communicators were aborted",
         rank_, size_);
  if (bcast_late_)
    fail(DDP_ERR_TIMEOUT,
         "rank %d of %d: an earlier ddp_broadcast did not complete before the timeout (another rank stalled, died or "
         "issued a different collective): the communicators were aborted",
         rank_, size_);
  if (aborted_ || !comm_) fail(DDP_ERR_ABORTED, "the NCCL communicator was aborted after an earlier error");
}

std::unique_lock<std::mutex> NcclComm::hold() {
  std::unique_lock<std::mutex> lock(mu_);
  live();
  return lock;
}

bool NcclComm::finalize() {
  if (!api().finalize) return true;
  ncclResult_t rc = settle(api().finalize(comm_), comm_, Deadline::after_ms(timeout_ms_));
  return rc == ncclSuccess;
}

// With NCCL 2.14 or later the communicator is made nonblocking and polled, so that a rank that never
// joins costs `timeout_ms`, not the job: then it is aborted.
ncclComm_t init_rank(const ncclUniqueId& id, int nranks, int rank, int64_t timeout_ms) {
  ncclComm_t c = nullptr;
  if (!api().init_config) {
    DDP_NCCL_CHECK(ncclCommInitRank(&c, nranks, id, rank), nullptr);
    return c;
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t rc = api().init_config(&c, nranks, id, rank, &config);
  if (rc == ncclSuccess || rc == ncclInProgress) rc = settle(ncclInProgress, c, Deadline::after_ms(timeout_ms));
  if (rc == ncclSuccess) return c;
  const std::string last = nccl_last_error(c);
  if (c) ncclCommAbort(c);
  if (rc == ncclInProgress)
    fail(DDP_ERR_TIMEOUT,
         "rank %d of %d: the NCCL communicator was not created within %lld ms: a rank did not call "
         "ddp_comm_init_nccl with the same id and nranks, died, or cannot reach this one",
         rank, nranks, static_cast<long long>(timeout_ms));
  fail(DDP_ERR_NCCL, "ncclCommInitRankConfig failed: %s%s%s", ncclGetErrorString(rc), last.empty() ? "" : ": ",
       last.c_str());
}

namespace {

std::unique_ptr<Comm> make_nccl_comm_over(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device,
                                          int64_t timeout_ms, std::unique_ptr<Comm> host) {
  require_cuda_device(cuda_device);
  ncclUniqueId uid;
  std::memcpy(&uid, id->bytes, sizeof uid);
  DeviceGuard g(cuda_device);
  ncclComm_t c = init_rank(uid, nranks, rank, timeout_ms);
  try {
    return std::unique_ptr<Comm>(new NcclComm(c, cuda_device, true, std::move(host), timeout_ms));
  } catch (...) {
    ncclCommAbort(c);
    throw;
  }
}

}  // namespace

}  // namespace nccl

void nccl_get_unique_id(ddp_nccl_id_t* id) {
  require_cuda_device(-1);
  ncclUniqueId uid;
  DDP_NCCL_CHECK(ncclGetUniqueId(&uid), nullptr);
  std::memcpy(id->bytes, &uid, sizeof uid);
}

std::unique_ptr<Comm> make_nccl_comm(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device,
                                     int64_t timeout_ms) {
  return nccl::make_nccl_comm_over(id, nranks, rank, cuda_device, timeout_ms, nullptr);
}

std::unique_ptr<Comm> make_nccl_comm_host(std::unique_ptr<Comm> host, int cuda_device, int64_t timeout_ms) {
  require_cuda_device(cuda_device);
  ddp_nccl_id_t id;
  std::memset(&id, 0, sizeof id);
  if (host->rank() == 0) nccl_get_unique_id(&id);
  const auto t0 = std::chrono::steady_clock::now();
  host->broadcast_host(&id, sizeof id, 0, Deadline::after_ms(timeout_ms));
  int64_t left = timeout_ms;
  if (timeout_ms > 0) {
    const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
    left = std::max<int64_t>(1, timeout_ms - spent.count());
  }
  const int nranks = host->size(), rank = host->rank();
  return nccl::make_nccl_comm_over(&id, nranks, rank, cuda_device, left, std::move(host));
}

std::unique_ptr<Comm> make_nccl_comm_mpi(const void* mpi_comm, int cuda_device, int64_t timeout_ms) {
  require_cuda_device(cuda_device);
  return make_nccl_comm_host(make_mpi_comm(mpi_comm), cuda_device, timeout_ms);
}

std::unique_ptr<Comm> wrap_nccl_comm(void* nccl_comm) {
  require_cuda_device(-1);
  ncclComm_t c = static_cast<ncclComm_t>(nccl_comm);
  int device = -1;
  DDP_NCCL_CHECK(ncclCommCuDevice(c, &device), c);
  return std::unique_ptr<Comm>(new nccl::NcclComm(c, device, false));
}

}  // namespace ddp
