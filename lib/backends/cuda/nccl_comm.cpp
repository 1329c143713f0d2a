// The NCCL communicator: device memory, CUDA streams. Collectives are enqueued on the bucket stream
// and complete asynchronously; their errors and stalls are found by the stream's polls
// (ncclCommGetAsyncError against the collective's deadline) and surface at the next call.
#include "core/comms.hpp"

#include <dlfcn.h>
#include <nccl.h>
#include <sched.h>

#include <cstring>
#include <mutex>
#include <thread>

#include "kernels/elementwise.h"
#include "backends/cuda/cuda_device.hpp"

namespace ddp {

namespace {

// One macro for every NCCL return code. `comm` (may be null) adds NCCL's last error text.
const char* nccl_last_error(ncclComm_t comm);
#define DDP_NCCL_CHECK(call, comm)                                                     \
  do {                                                                                 \
    ncclResult_t ddp_nccl_rc_ = (call);                                                \
    if (ddp_nccl_rc_ != ncclSuccess)                                                   \
      fail(DDP_ERR_NCCL, "%s failed: %s%s%s", #call, ncclGetErrorString(ddp_nccl_rc_), \
           nccl_last_error(comm)[0] ? ": " : "", nccl_last_error(comm));               \
  } while (0)

static_assert(sizeof(ddp_nccl_id_t) == sizeof(ncclUniqueId), "ddp_nccl_id_t must hold an ncclUniqueId");

// Functions newer than NCCL 2.10 are looked up at run time, so that the library still loads (and says
// what is missing) with an older libnccl.so.2.
struct NcclApi {
  int version = 0;  // ncclGetVersion: 10000*major + 100*minor + patch (2.9 and later)
  ncclResult_t (*comm_split)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) = nullptr;  // 2.18
  ncclResult_t (*premul_create)(ncclRedOp_t*, void*, ncclDataType_t, ncclScalarResidence_t,
                                ncclComm_t) = nullptr;            // 2.11
  ncclResult_t (*op_destroy)(ncclRedOp_t, ncclComm_t) = nullptr;  // 2.11
  const char* (*last_error)(ncclComm_t) = nullptr;                // 2.13
};

const NcclApi& api() {
  static NcclApi a;
  static std::once_flag once;
  std::call_once(once, [] {
    int v = 0;
    if (ncclGetVersion(&v) == ncclSuccess) a.version = v < 10000 ? (v / 1000) * 10000 + (v % 1000) : v;
    // The NCCL libddp was loaded with; RTLD_DEFAULT finds it too when NCCL was linked statically
    // into the program or loaded globally under another name.
    void* h = dlopen("libnccl.so.2", RTLD_LAZY | RTLD_NOLOAD);
    if (!h) h = dlopen("libnccl.so", RTLD_LAZY | RTLD_NOLOAD);
    void* scope = h ? h : RTLD_DEFAULT;
    a.comm_split = reinterpret_cast<decltype(a.comm_split)>(dlsym(scope, "ncclCommSplit"));
    a.premul_create = reinterpret_cast<decltype(a.premul_create)>(dlsym(scope, "ncclRedOpCreatePreMulSum"));
    a.op_destroy = reinterpret_cast<decltype(a.op_destroy)>(dlsym(scope, "ncclRedOpDestroy"));
    a.last_error = reinterpret_cast<decltype(a.last_error)>(dlsym(scope, "ncclGetLastError"));
    if (h) dlclose(h);  // NOLOAD took a reference to the already loaded library; it stays loaded
    if (a.version < 21800) a.comm_split = nullptr;
    if (a.version < 21100) a.premul_create = nullptr, a.op_destroy = nullptr;
  });
  return a;
}

const char* nccl_last_error(ncclComm_t comm) {
  const NcclApi& a = api();
  if (!a.last_error) return "";
  const char* s = a.last_error(comm);
  return s ? s : "";
}

ncclDataType_t nccl_type(Dtype d) {
  switch (d) {
    case Dtype::F16: return ncclFloat16;
    case Dtype::BF16: return ncclBfloat16;
    case Dtype::F32: return ncclFloat32;
    case Dtype::F64: return ncclFloat64;
  }
  return ncclFloat32;
}

class NcclComm final : public Comm, public AsyncErrorSource {
 public:
  NcclComm(ncclComm_t c, int device, bool owned) : comm_(c), device_(device), owned_(owned) {
    DDP_NCCL_CHECK(ncclCommUserRank(comm_, &rank_), comm_);
    DDP_NCCL_CHECK(ncclCommCount(comm_, &size_), comm_);
  }
  ~NcclComm() override {
    int prev = -1;
    cudaGetDevice(&prev);
    if (prev != device_) cudaSetDevice(device_);
    if (comm_ && !stalled_)
      for (auto& op : ops_) api().op_destroy(op.op, comm_);
    if (comm_ && owned_) {
      if (stalled_)
        ncclCommAbort(comm_);  // a stuck collective would make ncclCommDestroy wait forever
      else
        ncclCommDestroy(comm_);
    }
    if (ctrl_stream_) cudaStreamDestroy(ctrl_stream_);
    cudaFree(ctrl_buf_);
    if (prev >= 0 && prev != device_) cudaSetDevice(prev);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::Device; }

  std::unique_ptr<Comm> dup() override {
    live();
    DeviceGuard g(device_);
    ncclComm_t c = nullptr;
    if (api().comm_split) {
      DDP_NCCL_CHECK(api().comm_split(comm_, 0, rank_, &c, nullptr), comm_);
    } else {
      // Before NCCL 2.18: a fresh id from rank 0, sent over this communicator.
      ncclUniqueId id;
      std::memset(&id, 0, sizeof id);
      if (rank_ == 0) DDP_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
      broadcast_host(&id, sizeof id, 0, Deadline::never());
      DDP_NCCL_CHECK(ncclCommInitRank(&c, size_, id, rank_), nullptr);
    }
    return std::unique_ptr<Comm>(new NcclComm(c, device_, true));
  }

  std::unique_ptr<Device> make_device() override { return std::unique_ptr<Device>(new CudaDevice(device_)); }

  bool supports_wire(Dtype d) const override { return d != Dtype::BF16 || api().version >= 21000; }
  bool supports(RedOp op) const override {
    switch (op) {
      case RedOp::Sum: return true;
      case RedOp::Avg: return api().version >= 21000;
      case RedOp::PreMulSum: return api().premul_create != nullptr && api().op_destroy != nullptr;
      case RedOp::SumScaled: return false;  // the device's unpack or scale pass applies the factor
    }
    return false;
  }

  void allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream& s, Deadline dl) override {
    live();
    CudaStream* cs = dynamic_cast<CudaStream*>(&s);
    if (!cs) fail(DDP_ERR_INTERNAL, "NCCL comm: given a stream that is not a CUDA stream");
    if (!supports_wire(d))
      fail(DDP_ERR_UNSUPPORTED, "NCCL %d.%d has no %s arithmetic (2.10 or later has)", api().version / 10000,
           api().version / 100 % 100, dtype_name(d));
    DeviceGuard g(device_);
    DDP_NCCL_CHECK(ncclAllReduce(send, recv, n, nccl_type(d), op_for(red, d), comm_, cs->stream()), comm_);
    cs->watch(this, dl);
  }

  void broadcast(void* buf, size_t bytes, int root, void* user_stream, Deadline) override {
    live();
    if (root < 0 || root >= size_)
      fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size_ - 1);
    DeviceGuard g(device_);
    DDP_NCCL_CHECK(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, static_cast<cudaStream_t>(user_stream)),
                   comm_);
  }

  bool can_group() const override { return true; }
  void group_start() override { DDP_NCCL_CHECK(ncclGroupStart(), nullptr); }
  void group_end() override { DDP_NCCL_CHECK(ncclGroupEnd(), comm_); }

  // The control path: host bytes staged through device memory on the communicator's own stream, and
  // waited for by polling against the deadline.
  void allgather_host(const void* in, void* out, size_t bytes, Deadline dl) override {
    live();
    DeviceGuard g(device_);
    char* d = ctrl_buffer(bytes * (static_cast<size_t>(size_) + 1));
    DDP_CUDA_CHECK(cudaMemcpyAsync(d, in, bytes, cudaMemcpyHostToDevice, ctrl_stream_));
    DDP_NCCL_CHECK(ncclAllGather(d, d + bytes, bytes, ncclUint8, comm_, ctrl_stream_), comm_);
    wait_ctrl(dl, "NCCL allgather (control path)");
    DDP_CUDA_CHECK(cudaMemcpy(out, d + bytes, bytes * static_cast<size_t>(size_), cudaMemcpyDeviceToHost));
  }

  void broadcast_host(void* buf, size_t bytes, int root, Deadline dl) override {
    live();
    if (root < 0 || root >= size_)
      fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size_ - 1);
    if (bytes == 0) return;
    DeviceGuard g(device_);
    char* d = ctrl_buffer(bytes);
    if (rank_ == root) DDP_CUDA_CHECK(cudaMemcpyAsync(d, buf, bytes, cudaMemcpyHostToDevice, ctrl_stream_));
    DDP_NCCL_CHECK(ncclBroadcast(d, d, bytes, ncclUint8, root, comm_, ctrl_stream_), comm_);
    wait_ctrl(dl, "NCCL broadcast (control path)");
    DDP_CUDA_CHECK(cudaMemcpy(buf, d, bytes, cudaMemcpyDeviceToHost));
  }

  void abort() override {
    if (!comm_ || aborted_) return;
    aborted_ = true;
    stalled_ = true;  // nothing may wait on this communicator any more
    if (owned_) {
      DeviceGuard g(device_);
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  void check_async() override {
    if (!comm_) return;
    ncclResult_t async = ncclSuccess;
    DDP_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async), comm_);
    if (async != ncclSuccess && async != ncclInProgress) {
      std::string text = format("NCCL reported an asynchronous error: %s%s%s", ncclGetErrorString(async),
                                nccl_last_error(comm_)[0] ? ": " : "", nccl_last_error(comm_));
      mark_stalled();  // NCCL's rule: a communicator with an asynchronous error is aborted
      throw Error(DDP_ERR_NCCL, text);
    }
  }
  // A collective of this communicator is stuck: abort now, so that nothing (a later cudaFree, the
  // context's teardown) waits on its kernels forever.
  void mark_stalled() override {
    stalled_ = true;
    abort();
  }

 private:
  void live() const {
    if (aborted_ || !comm_) fail(DDP_ERR_ABORTED, "the NCCL communicator was aborted after an earlier error");
  }

  // The reduction for `red` on `d`: premultiplied sums are made once per (dtype, factor) and kept.
  ncclRedOp_t op_for(Reduction red, Dtype d) {
    switch (red.op) {
      case RedOp::Sum: return ncclSum;
      case RedOp::Avg:
        if (!supports(RedOp::Avg)) fail(DDP_ERR_UNSUPPORTED, "ncclAvg needs NCCL 2.10 or later");
        return ncclAvg;
      case RedOp::PreMulSum: break;
      case RedOp::SumScaled: fail(DDP_ERR_INTERNAL, "NCCL comm: a scaled sum is not fused");
    }
    for (const auto& op : ops_)
      if (op.dtype == d && op.factor == red.factor) return op.op;
    if (!supports(RedOp::PreMulSum)) fail(DDP_ERR_UNSUPPORTED, "ncclRedOpCreatePreMulSum needs NCCL 2.11 or later");
    // The scalar has the collective's type: a 16-bit factor is rounded to 16 bits here.
    double f64 = red.factor;
    float f32 = static_cast<float>(red.factor);
    uint16_t f16 = d == Dtype::F16 ? elem::f32_to_f16(f32) : elem::f32_to_bf16(f32);
    void* scalar = d == Dtype::F64 ? static_cast<void*>(&f64) : d == Dtype::F32 ? static_cast<void*>(&f32) : &f16;
    ncclRedOp_t op;
    DDP_NCCL_CHECK(api().premul_create(&op, scalar, nccl_type(d), ncclScalarHostImmediate, comm_), comm_);
    ops_.push_back(PreMulOp{d, red.factor, op});
    return op;
  }

  char* ctrl_buffer(size_t bytes) {
    if (!ctrl_stream_) DDP_CUDA_CHECK(cudaStreamCreateWithFlags(&ctrl_stream_, cudaStreamNonBlocking));
    if (bytes > ctrl_bytes_) {
      cudaFree(ctrl_buf_);
      ctrl_buf_ = nullptr;
      ctrl_bytes_ = 0;
      DDP_CUDA_CHECK(cudaMalloc(&ctrl_buf_, bytes));
      ctrl_bytes_ = bytes;
    }
    return static_cast<char*>(ctrl_buf_);
  }

  void wait_ctrl(Deadline dl, const char* what) {
    for (unsigned spin = 0;; ++spin) {
      cudaError_t rc = cudaStreamQuery(ctrl_stream_);
      if (rc == cudaSuccess) return;
      if (rc != cudaErrorNotReady) DDP_CUDA_CHECK(rc);
      check_async();
      if (dl.passed()) {
        mark_stalled();
        fail(DDP_ERR_TIMEOUT,
             "%s did not complete before the timeout: another rank stalled, died or issued a "
             "different collective",
             what);
      }
      if (spin < 64)
        sched_yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  struct PreMulOp {
    Dtype dtype;
    double factor;
    ncclRedOp_t op;
  };

  ncclComm_t comm_;
  int device_;
  bool owned_;
  int rank_ = 0, size_ = 1;
  bool aborted_ = false, stalled_ = false;
  std::vector<PreMulOp> ops_;
  cudaStream_t ctrl_stream_ = nullptr;
  void* ctrl_buf_ = nullptr;
  size_t ctrl_bytes_ = 0;
};

}  // namespace

void nccl_get_unique_id(ddp_nccl_id_t* id) {
  require_cuda_device(-1);
  ncclUniqueId uid;
  DDP_NCCL_CHECK(ncclGetUniqueId(&uid), nullptr);
  std::memcpy(id->bytes, &uid, sizeof uid);
}

std::unique_ptr<Comm> make_nccl_comm(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device) {
  require_cuda_device(cuda_device);
  ncclUniqueId uid;
  std::memcpy(&uid, id->bytes, sizeof uid);
  DeviceGuard g(cuda_device);
  ncclComm_t c = nullptr;
  DDP_NCCL_CHECK(ncclCommInitRank(&c, nranks, uid, rank), nullptr);
  try {
    return std::unique_ptr<Comm>(new NcclComm(c, cuda_device, true));
  } catch (...) {
    ncclCommDestroy(c);
    throw;
  }
}

std::unique_ptr<Comm> make_nccl_comm_mpi(const void* mpi_comm, int cuda_device) {
  require_cuda_device(cuda_device);
  std::unique_ptr<Comm> mpi = make_mpi_comm(mpi_comm);
  ddp_nccl_id_t id;
  std::memset(&id, 0, sizeof id);
  if (mpi->rank() == 0) nccl_get_unique_id(&id);
  mpi->broadcast_host(&id, sizeof id, 0, Deadline::never());
  return make_nccl_comm(&id, mpi->size(), mpi->rank(), cuda_device);
}

std::unique_ptr<Comm> wrap_nccl_comm(void* nccl_comm) {
  require_cuda_device(-1);
  ncclComm_t c = static_cast<ncclComm_t>(nccl_comm);
  int device = -1;
  DDP_NCCL_CHECK(ncclCommCuDevice(c, &device), c);
  return std::unique_ptr<Comm>(new NcclComm(c, device, false));
}

}  // namespace ddp
