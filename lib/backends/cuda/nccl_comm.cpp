// The NCCL communicator: device memory, CUDA streams. Collectives are enqueued on the bucket stream
// and complete asynchronously; their errors and stalls are found by the stream's polls
// (ncclCommGetAsyncError against the collective's deadline) and surface at the next call.
#include "core/comms.hpp"

#include <dlfcn.h>
#include <nccl.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "kernels/elementwise.h"
#include "backends/cuda/cuda_device.hpp"

namespace ddp {

namespace {

void nccl_check(ncclResult_t rc, ncclComm_t comm, Deadline dl, const char* call);
ncclComm_t init_rank(const ncclUniqueId& id, int nranks, int rank, int64_t timeout_ms);

// One macro for every NCCL return code: a call a nonblocking communicator answers with ncclInProgress
// is waited for until `dl` (DDP_ERR_TIMEOUT after it). `comm` (may be null) is the communicator the
// call works on; NCCL's last error text is added to the message.
#define DDP_NCCL_RUN(call, comm, dl) nccl_check((call), (comm), (dl), #call)
#define DDP_NCCL_CHECK(call, comm) nccl_check((call), (comm), Deadline::never(), #call)

static_assert(sizeof(ddp_nccl_id_t) == sizeof(ncclUniqueId), "ddp_nccl_id_t must hold an ncclUniqueId");

// Functions newer than NCCL 2.10 are looked up at run time, so that the library still loads (and says
// what is missing) with an older libnccl.so.2.
struct NcclApi {
  int version = 0;  // ncclGetVersion: 10000*major + 100*minor + patch (2.9 and later)
  ncclResult_t (*comm_split)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) = nullptr;  // 2.18
  ncclResult_t (*premul_create)(ncclRedOp_t*, void*, ncclDataType_t, ncclScalarResidence_t,
                                ncclComm_t) = nullptr;                                        // 2.11
  ncclResult_t (*op_destroy)(ncclRedOp_t, ncclComm_t) = nullptr;                              // 2.11
  const char* (*last_error)(ncclComm_t) = nullptr;                                            // 2.13
  ncclResult_t (*init_config)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;  // 2.14
  ncclResult_t (*finalize)(ncclComm_t) = nullptr;                                             // 2.14
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
    a.init_config = reinterpret_cast<decltype(a.init_config)>(dlsym(scope, "ncclCommInitRankConfig"));
    a.finalize = reinterpret_cast<decltype(a.finalize)>(dlsym(scope, "ncclCommFinalize"));
    if (h) dlclose(h);  // NOLOAD took a reference to the already loaded library; it stays loaded
    if (a.version < 21800) a.comm_split = nullptr;
    if (a.version < 21100) a.premul_create = nullptr, a.op_destroy = nullptr;
    if (a.version < 21400) a.init_config = nullptr, a.finalize = nullptr;  // no nonblocking communicators
  });
  return a;
}

const char* nccl_last_error(ncclComm_t comm) {
  const NcclApi& a = api();
  if (!a.last_error) return "";
  const char* s = a.last_error(comm);
  return s ? s : "";
}

void backoff(unsigned spin) {
  if (spin < 64)
    sched_yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(spin < 1024 ? 50 : 1000));
}

// What is left of `dl` as a creation bound in milliseconds (0: none, as init_rank takes it).
int64_t ms_left(Deadline dl) {
  if (dl.infinite()) return 0;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(dl.at() - std::chrono::steady_clock::now());
  return std::max<int64_t>(1, left.count());
}

// A nonblocking communicator answers ncclInProgress while a call goes on in the background, and
// nothing else may be called on it until ncclCommGetAsyncError stops saying so. ncclInProgress here
// means `dl` passed first.
ncclResult_t settle(ncclResult_t rc, ncclComm_t comm, Deadline dl) {
  if (rc != ncclInProgress || !comm) return rc;
  for (unsigned spin = 0;; ++spin) {
    ncclResult_t state = ncclInProgress;
    if (ncclResult_t q = ncclCommGetAsyncError(comm, &state)) return q;
    if (state != ncclInProgress || dl.passed()) return state;
    backoff(spin);
  }
}

// A call that was accepted (ncclInProgress) and then failed failed asynchronously: a nonblocking
// communicator's poll reports the error of a collective that already ran, as ncclCommGetAsyncError does.
void nccl_check(ncclResult_t rc, ncclComm_t comm, Deadline dl, const char* call) {
  const bool accepted = rc == ncclInProgress;
  rc = settle(rc, comm, dl);
  if (rc == ncclSuccess) return;
  if (rc == ncclInProgress)
    fail(DDP_ERR_TIMEOUT, "%s did not complete before the timeout: another rank stalled or died", call);
  const char* last = nccl_last_error(comm);
  fail(DDP_ERR_NCCL, "%s failed: %s%s%s%s", call, accepted ? "NCCL reported an asynchronous error: " : "",
       ncclGetErrorString(rc), last[0] ? ": " : "", last);
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

class NcclComm;

// The communicators split from one parent (a context's control, broadcast and stream communicators
// share one). NCCL's abort of one communicator waits for the device's kernels, and a sibling's kernel
// spinning on a dead peer stops only when that sibling is aborted: so all of them are aborted at
// once, each on its own thread, never one after another.
struct Family {
  std::mutex mu;
  std::vector<NcclComm*> members;
  std::atomic<bool> late{false};     // a member's collective passed its deadline: all were aborted
  std::atomic<bool> severed{false};  // elastic: a peer was lost and the siblings were closed for it
  void join(NcclComm* c) {
    std::lock_guard<std::mutex> lock(mu);
    members.push_back(c);
  }
  void leave(NcclComm* c) {
    std::lock_guard<std::mutex> lock(mu);
    members.erase(std::remove(members.begin(), members.end(), c), members.end());
  }
  void abort_all();
};

class NcclComm final : public Comm, public AsyncErrorSource, public Watched {
 public:
  // `mpi` (may be null) is the MPI communicator the NCCL one was made over; `timeout_ms` bounds
  // the creation of duplicates. `family` (null for a parent) are the siblings it is aborted with.
  NcclComm(ncclComm_t c, int device, bool owned, std::unique_ptr<Comm> mpi = nullptr, int64_t timeout_ms = 0,
           std::shared_ptr<Family> family = nullptr)
      : comm_(c),
        device_(device),
        owned_(owned),
        mpi_(std::move(mpi)),
        timeout_ms_(timeout_ms),
        family_(std::move(family)) {
    DDP_NCCL_CHECK(ncclCommUserRank(comm_, &rank_), comm_);
    DDP_NCCL_CHECK(ncclCommCount(comm_, &size_), comm_);
    if (family_) family_->join(this);
    member_ = family_ != nullptr;
    watchdog_register(this);
  }
  // A membership that an elastic context agreed on over `host` (Gloo), whose NCCL communicator is
  // made at its first duplication (connect): the agreement and the creation fail apart, and a rank
  // that lost a member while creating it still holds the membership the others hold, to agree again
  // over.
  NcclComm(std::unique_ptr<Comm> host, int device, int64_t timeout_ms)
      : comm_(nullptr), device_(device), owned_(true), mpi_(std::move(host)), timeout_ms_(timeout_ms) {
    rank_ = mpi_->rank();
    size_ = mpi_->size();
    watchdog_register(this);
  }
  ~NcclComm() override {
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

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::Device; }

  std::unique_ptr<Comm> dup() override {
    if (!comm_ && mpi_ && !aborted_) connect();
    live();
    DeviceGuard g(device_);
    std::unique_ptr<Comm> mpi = mpi_ ? mpi_->dup() : nullptr;
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
    return std::unique_ptr<Comm>(new NcclComm(c, device_, true, std::move(mpi), timeout_ms_, family_));
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
    cudaStream_t cs = collective_stream(s, d);
    DeviceGuard g(device_);
    std::unique_lock<std::mutex> lock = hold();
    DDP_NCCL_RUN(ncclAllReduce(send, recv, n, nccl_type(d), op_for(red, d), comm_, cs), comm_, dl);
    in_group(dl);
    wire_bytes()->allreduce(n * dtype_size(d), size_);  // NCCL's algorithm is its own: the ring's formula
    s.watch(this, dl);
  }

  // In place: this rank's chunk is its own part of the buffer (NCCL's in-place rule).
  void reduce_scatter(void* buf, size_t m, Dtype d, Reduction red, Stream& s, Deadline dl) override {
    cudaStream_t cs = collective_stream(s, d);
    DeviceGuard g(device_);
    std::unique_lock<std::mutex> lock = hold();
    void* mine = static_cast<char*>(buf) + static_cast<size_t>(rank_) * m * dtype_size(d);
    DDP_NCCL_RUN(ncclReduceScatter(buf, mine, m, nccl_type(d), op_for(red, d), comm_, cs), comm_, dl);
    in_group(dl);
    wire_bytes()->reduce_scatter(m * static_cast<size_t>(size_) * dtype_size(d), size_);
    s.watch(this, dl);
  }

  void allgather(void* buf, size_t bytes, Stream& s, Deadline dl) override {
    cudaStream_t cs = collective_stream(s, Dtype::F32);
    DeviceGuard g(device_);
    std::unique_lock<std::mutex> lock = hold();
    const void* mine = static_cast<const char*>(buf) + static_cast<size_t>(rank_) * bytes;
    DDP_NCCL_RUN(ncclAllGather(mine, buf, bytes, ncclUint8, comm_, cs), comm_, dl);
    in_group(dl);
    wire_bytes()->allgather(bytes, size_);
    s.watch(this, dl);
  }

  // The int8 wire's reduce-scatter: a send to and a receive from every rank (itself included), in
  // one group so that NCCL matches and overlaps them (ncclSend / ncclRecv: NCCL 2.7).
  bool has_alltoall() const override { return api().version >= 20700; }
  void alltoall(const void* send, void* recv, size_t bytes, Stream& s, Deadline dl) override {
    cudaStream_t cs = collective_stream(s, Dtype::F32);
    DeviceGuard g(device_);
    std::unique_lock<std::mutex> lock = hold();
    group_start();
    try {
      for (int j = 0; j < size_; ++j) {
        const size_t at = static_cast<size_t>(j) * bytes;
        DDP_NCCL_RUN(ncclSend(static_cast<const char*>(send) + at, bytes, ncclUint8, j, comm_, cs), comm_, dl);
        DDP_NCCL_RUN(ncclRecv(static_cast<char*>(recv) + at, bytes, ncclUint8, j, comm_, cs), comm_, dl);
      }
      in_group(dl);
    } catch (...) {
      try {
        group_end();
      } catch (...) {
      }
      throw;
    }
    group_end();
    wire_bytes()->alltoall(bytes, size_);
    s.watch(this, dl);
  }

  void broadcast(void* buf, size_t bytes, int root, void* user_stream, Deadline dl) override {
    live();
    if (root < 0 || root >= size_)
      fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size_ - 1);
    DeviceGuard g(device_);
    cudaStream_t us = static_cast<cudaStream_t>(user_stream);
    std::unique_lock<std::mutex> lock = hold();
    DDP_NCCL_RUN(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, us), comm_, dl);
    wire_bytes()->broadcast(bytes, size_, rank_, root);
    watch_broadcast(us, dl);
  }

  bool can_group() const override { return true; }
  void group_start() override {
    DDP_NCCL_CHECK(ncclGroupStart(), nullptr);
    ++t_group.depth;
  }
  // A group may hold the collectives of several communicators (one per bucket stream); when NCCL
  // answers ncclInProgress, every one of them is polled.
  void group_end() override {
    ncclResult_t rc = ncclGroupEnd();
    if (--t_group.depth > 0) return DDP_NCCL_CHECK(rc, nullptr);
    std::vector<GroupMember> members;
    members.swap(t_group.members);
    if (rc != ncclInProgress) return DDP_NCCL_CHECK(rc, comm_);
    for (const GroupMember& m : members) DDP_NCCL_RUN(rc, m.comm, m.deadline);
  }

  // Through the MPI communicator this one was made over; without one, nothing can be asked.
  std::unique_ptr<Prober> make_prober(std::function<Position()> mine) override {
    return mpi_ ? mpi_->make_prober(std::move(mine)) : nullptr;
  }

  // The control path: host bytes staged through device memory on the communicator's own stream, and
  // waited for by polling against the deadline.
  void allgather_host(const void* in, void* out, size_t bytes, Deadline dl) override {
    if (!comm_ && mpi_ && !aborted_) {  // a membership agreed on, its NCCL communicator not made yet
      mpi_->allgather_host(in, out, bytes, dl);
      wire_bytes()->allgather(bytes, size_);
      return;
    }
    live();
    if (host_control()) {
      mpi_->allgather_host(in, out, bytes, dl);
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

  void broadcast_host(void* buf, size_t bytes, int root, Deadline dl) override {
    live();
    if (root < 0 || root >= size_)
      fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size_ - 1);
    if (bytes == 0) return;
    if (host_control()) {
      mpi_->broadcast_host(buf, bytes, root, dl);
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

  void abort() override {
    if (member_)
      family_->abort_all();
    else
      abort_one();
  }

  // Elastic contexts, on a communicator made over a Gloo one (ddp_comm_init_nccl_store): the Gloo
  // communicator agrees on the ranks left (or admits joiners) through its store and carries a new
  // NCCL id to them; the old NCCL communicators are aborted, never reused.
  bool can_regroup() const override { return mpi_ && mpi_->can_regroup(); }
  // Aborts every sibling and closes the host connections: peers blocked on this rank's prober or
  // control path fail now. A severed communicator's streams fail (check_async), where an abort
  // alone would let them end as if their collectives had completed.
  void sever() override { severer()(); }
  std::function<void()> severer() override {
    std::function<void()> host = mpi_ ? mpi_->severer() : std::function<void()>([] {});
    if (member_) {
      std::shared_ptr<Family> family = family_;
      return [host, family] {
        family->severed = true;
        family->abort_all();
        host();
      };
    }
    // A parent (not split by libddp) is severed only by its owner, through sever(), while it lives.
    return [this, host] {
      severed_ = true;
      abort_one();
      host();
    };
  }
  Regrouped regroup(const std::string& epoch, int64_t committed,
                    const std::function<std::vector<Liveness>()>& answering, Deadline window, Deadline dl) override {
    if (!can_regroup())
      fail(DDP_ERR_UNSUPPORTED,
           "this NCCL communicator cannot be rebuilt over fewer ranks: only one made over a Gloo store "
           "(ddp_comm_init_nccl_store) can");
    Regrouped g = mpi_->regroup(epoch, committed, answering, window, dl);
    g.comm.reset(new NcclComm(std::move(g.comm), device_, timeout_ms_));
    return g;
  }
  std::shared_ptr<JoinDesk> join_desk() override { return can_regroup() ? mpi_->join_desk() : nullptr; }
  // The new membership's Gloo communicator first (the joiners meet it in their join), then an NCCL
  // communicator over it, made the same way on the joiners (NcclJoiningComm::join).
  std::unique_ptr<Comm> admit(const std::string& name, const std::vector<int64_t>& slots, const std::string& note,
                              Deadline dl) override {
    if (!can_regroup()) return Comm::admit(name, slots, note, dl);
    return std::unique_ptr<Comm>(new NcclComm(mpi_->admit(name, slots, note, dl), device_, timeout_ms_));
  }
  // The NCCL communicator of a membership agreed on (see the constructor above): the id made by
  // rank 0 and sent over the host communicator, within the creation's bound (ddp_recover's).
  void connect() {
    const Deadline dl = Deadline::earlier(creation_deadline(), Deadline::after_ms(timeout_ms_));
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (rank_ == 0) {
      DeviceGuard g(device_);
      DDP_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
    }
    mpi_->broadcast_host(&id, sizeof id, 0, dl);
    DeviceGuard g(device_);
    ncclComm_t c = init_rank(id, size_, rank_, ms_left(dl));
    std::lock_guard<std::mutex> lock(mu_);
    comm_ = c;
  }

  // ncclCommAbort of this communicator alone (the family aborts its members each on a thread).
  void abort_one() {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;
    aborted_ = true;
    stalled_ = true;  // nothing may wait on this communicator any more
    if (owned_ && comm_) {
      DeviceGuard g(device_, true);
      ncclCommAbort(comm_);
    }
  }

  void check_async() override {
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
  void mark_stalled() override {
    stalled_ = true;
    late_ = true;
    if (member_) family_->late = true;
    abort();
  }
  std::string who() const override { return format("rank %d of %d", rank_, size_); }

  // The watchdog's check of ddp_broadcast (enqueued on the user's stream, which no libddp call
  // polls): past its deadline, the communicators are aborted and the next broadcast says why.
  void scan() override {
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

 private:
  // The calls of a group are enqueued at its end: the communicators it holds are remembered.
  struct GroupMember {
    ncclComm_t comm;
    Deadline deadline;
  };
  struct Group {
    int depth = 0;
    std::vector<GroupMember> members;
  };
  static thread_local Group t_group;
  void in_group(Deadline dl) {
    if (t_group.depth == 0) return;
    for (const GroupMember& m : t_group.members)
      if (m.comm == comm_) return;
    t_group.members.push_back(GroupMember{comm_, dl});
  }

  // Whether the control path runs over the host communicator (Gloo, which bounds its own waits and
  // fails at once when a peer's connection closes: an elastic job learns of a death there without
  // waiting for its timeout) rather than through device memory. Not over MPI, whose blocking calls
  // would wait for a dead peer forever.
  bool host_control() const { return mpi_ && mpi_->can_regroup(); }

  // The CUDA stream under a bucket stream (the stream's own native handle: no type test).
  cudaStream_t collective_stream(Stream& s, Dtype d) const {
    live();
    cudaStream_t cs = static_cast<cudaStream_t>(s.native());
    if (!cs) fail(DDP_ERR_INTERNAL, "NCCL comm: given a stream that is not a CUDA stream");
    if (!supports_wire(d))
      fail(DDP_ERR_UNSUPPORTED, "NCCL %d.%d has no %s arithmetic (2.10 or later has)", api().version / 10000,
           api().version / 100 % 100, dtype_name(d));
    return cs;
  }

  void live() const {
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

  // The lock every NCCL call on comm_ holds, taken only while the communicator is alive.
  std::unique_lock<std::mutex> hold() {
    std::unique_lock<std::mutex> lock(mu_);
    live();
    return lock;
  }

  // A broadcast on the user's stream: an event after it, checked by the watchdog against `dl`.
  void watch_broadcast(cudaStream_t us, Deadline dl) {
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

  // Device memory and its pinned host twin: results come back on the control stream, whose own
  // wait keeps the deadline (a blocking copy on the legacy stream would wait for the user's
  // blocking streams too, with no deadline).
  char* ctrl_buffer(size_t bytes) {
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

  void wait_ctrl(Deadline dl, const char* what) {
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

  // Flushes a communicator before it is destroyed (ncclCommFinalize, bounded like creation); false
  // if that failed or did not end in time, and the communicator must be aborted instead.
  bool finalize() {
    if (!api().finalize) return true;
    ncclResult_t rc = settle(api().finalize(comm_), comm_, Deadline::after_ms(timeout_ms_));
    return rc == ncclSuccess;
  }

  struct PreMulOp {
    Dtype dtype;
    double factor;
    ncclRedOp_t op;
  };

  ncclComm_t comm_;  // never used once aborted_
  int device_;
  bool owned_;
  std::unique_ptr<Comm> mpi_;
  int64_t timeout_ms_;
  std::shared_ptr<Family> family_;
  bool member_ = false;  // split by libddp: aborted with its family
  int rank_ = 0, size_ = 1;
  // The watchdog thread aborts too: mu_ orders every NCCL call on comm_ with the abort.
  std::mutex mu_;
  std::atomic<bool> aborted_{false}, stalled_{false}, late_{false}, severed_{false};
  std::vector<PreMulOp> ops_;
  cudaStream_t ctrl_stream_ = nullptr;
  void* ctrl_buf_ = nullptr;
  char* ctrl_host_ = nullptr;
  size_t ctrl_bytes_ = 0;
  std::mutex bcast_mu_;  // guards the broadcasts the watchdog checks
  std::deque<std::pair<cudaEvent_t, Deadline>> bcast_pending_;
  std::vector<cudaEvent_t> bcast_events_;  // spare
  std::atomic<bool> bcast_late_{false};
};

// Held throughout: a member cannot leave (be destroyed) while it is being aborted.
void Family::abort_all() {
  std::lock_guard<std::mutex> lock(mu);
  std::vector<std::thread> threads;
  for (NcclComm* c : members) threads.emplace_back([c] { c->abort_one(); });
  for (std::thread& t : threads) t.join();
}

// A new communicator of `nranks`. With NCCL 2.14 or later it is made nonblocking and polled, so that
// a rank that never joins costs `timeout_ms`, not the job: then it is aborted.
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

std::unique_ptr<Comm> make_nccl_comm_over(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device,
                                          int64_t timeout_ms, std::unique_ptr<Comm> mpi) {
  require_cuda_device(cuda_device);
  ncclUniqueId uid;
  std::memcpy(&uid, id->bytes, sizeof uid);
  DeviceGuard g(cuda_device);
  ncclComm_t c = init_rank(uid, nranks, rank, timeout_ms);
  try {
    return std::unique_ptr<Comm>(new NcclComm(c, cuda_device, true, std::move(mpi), timeout_ms));
  } catch (...) {
    ncclCommAbort(c);
    throw;
  }
}

thread_local NcclComm::Group NcclComm::t_group;

// A joiner's membership, its NCCL communicator made at its first duplication (as the job's ranks'
// after NcclComm::admit).
std::unique_ptr<Comm> make_nccl_pending(std::unique_ptr<Comm> host, int device, int64_t timeout_ms) {
  return std::unique_ptr<Comm>(new NcclComm(std::move(host), device, timeout_ms));
}

// A joiner's communicator for an elastic NCCL job (ddp_comm_join_nccl): the Gloo joiner's request and
// wait, then an NCCL communicator over the Gloo communicator the job admits it to, made as the job's
// ranks make theirs in NcclComm::admit.
class NcclJoiningComm final : public Comm {
 public:
  NcclJoiningComm(std::unique_ptr<Comm> host, int device, int64_t timeout_ms)
      : host_(std::move(host)), device_(device), timeout_ms_(timeout_ms) {}
  int rank() const override { return -1; }
  int size() const override { return 0; }
  Memory memory() const override { return Memory::Device; }
  std::unique_ptr<Comm> dup() override {
    return std::unique_ptr<Comm>(new NcclJoiningComm(host_->dup(), device_, timeout_ms_));
  }
  std::unique_ptr<Device> make_device() override { return std::unique_ptr<Device>(new CudaDevice(device_)); }
  bool supports_wire(Dtype d) const override { return d != Dtype::BF16 || api().version >= 21000; }
  bool supports(RedOp op) const override { return op == RedOp::Sum; }
  // Nothing collective before the admission: the Gloo joiner refuses each call by name.
  void allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream& s, Deadline dl) override {
    host_->allreduce(send, recv, n, d, red, s, dl);
  }
  void broadcast(void* buf, size_t bytes, int root, void* user_stream, Deadline dl) override {
    host_->broadcast(buf, bytes, root, user_stream, dl);
  }
  void allgather_host(const void* in, void* out, size_t bytes, Deadline dl) override {
    host_->allgather_host(in, out, bytes, dl);
  }
  void broadcast_host(void* buf, size_t bytes, int root, Deadline dl) override {
    host_->broadcast_host(buf, bytes, root, dl);
  }
  bool can_regroup() const override { return true; }
  bool joining() const override { return true; }
  std::unique_ptr<Comm> join(const std::string& request, std::string* note, Deadline dl) override {
    return make_nccl_pending(host_->join(request, note, dl), device_, timeout_ms_);
  }

 private:
  std::unique_ptr<Comm> host_;
  int device_;
  int64_t timeout_ms_;
};

}  // namespace

void nccl_get_unique_id(ddp_nccl_id_t* id) {
  require_cuda_device(-1);
  ncclUniqueId uid;
  DDP_NCCL_CHECK(ncclGetUniqueId(&uid), nullptr);
  std::memcpy(id->bytes, &uid, sizeof uid);
}

std::unique_ptr<Comm> make_nccl_comm(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device,
                                     int64_t timeout_ms) {
  return make_nccl_comm_over(id, nranks, rank, cuda_device, timeout_ms, nullptr);
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
  return make_nccl_comm_over(&id, nranks, rank, cuda_device, left, std::move(host));
}

std::unique_ptr<Comm> make_nccl_comm_mpi(const void* mpi_comm, int cuda_device, int64_t timeout_ms) {
  require_cuda_device(cuda_device);
  return make_nccl_comm_host(make_mpi_comm(mpi_comm), cuda_device, timeout_ms);
}

std::unique_ptr<Comm> make_nccl_join_comm(const char* init_method, int cuda_device, int64_t timeout_ms) {
  require_cuda_device(cuda_device);
  return std::unique_ptr<Comm>(
      new NcclJoiningComm(make_gloo_join_comm(init_method, timeout_ms), cuda_device, timeout_ms));
}

std::unique_ptr<Comm> wrap_nccl_comm(void* nccl_comm) {
  require_cuda_device(-1);
  ncclComm_t c = static_cast<ncclComm_t>(nccl_comm);
  int device = -1;
  DDP_NCCL_CHECK(ncclCommCuDevice(c, &device), c);
  return std::unique_ptr<Comm>(new NcclComm(c, device, false));
}

}  // namespace ddp
