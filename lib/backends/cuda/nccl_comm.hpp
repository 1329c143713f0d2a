// The NCCL communicator: device memory, CUDA streams. Collectives are enqueued on the bucket stream
// and complete asynchronously; their errors and stalls are found by the stream's polls
// (ncclCommGetAsyncError against the collective's deadline) and surface at the next call. Its parts:
// creation, duplicates and ids (nccl_comm.cpp), the collectives and NCCL groups (nccl_collectives.cpp),
// the control path (nccl_control.cpp), aborts and the watchdog's checks (nccl_aborts.cpp), and the
// elastic paths over a Gloo communicator (nccl_elastic.cpp).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/cuda_calls.hpp"
#include "backends/cuda/nccl_calls.hpp"
#include "backends/cuda/watchdog.hpp"
#include "core/backend.hpp"

namespace ddp {
namespace nccl {

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

// A new communicator of `nranks` from `id`, given up after `timeout_ms` (0: never) where NCCL can
// create one without blocking.
ncclComm_t init_rank(const ncclUniqueId& id, int nranks, int rank, int64_t timeout_ms);

class NcclComm final : public Comm, public AsyncErrorSource, public Watched {
 public:
  // `host` (may be null) is the host communicator (MPI or Gloo) the NCCL one was made over, kept for
  // the stall inspector's prober and, when it can regroup (Gloo), for the control path and the
  // elastic paths; each duplicate holds a duplicate of it. `timeout_ms` bounds the creation of
  // duplicates. `family` (null for a parent) are the siblings it is aborted with.
  NcclComm(ncclComm_t c, int device, bool owned, std::unique_ptr<Comm> host = nullptr, int64_t timeout_ms = 0,
           std::shared_ptr<Family> family = nullptr);
  // A membership that an elastic context agreed on over `host` (Gloo), whose NCCL communicator is
  // made at its first duplication (connect): the agreement and the creation fail apart, and a rank
  // that lost a member while creating it still holds the membership the others hold, to agree again
  // over.
  NcclComm(std::unique_ptr<Comm> host, int device, int64_t timeout_ms);
  ~NcclComm() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::Device; }

  std::unique_ptr<Comm> dup() override;
  std::unique_ptr<Device> make_device() override;
  bool supports_wire(Dtype d) const override { return d != Dtype::BF16 || api().version >= 21000; }
  bool supports(RedOp op) const override;

  void allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream& s, Deadline dl) override;
  // In place: this rank's chunk is its own part of the buffer (NCCL's in-place rule).
  void reduce_scatter(void* buf, size_t m, Dtype d, Reduction red, Stream& s, Deadline dl) override;
  void allgather(void* buf, size_t bytes, Stream& s, Deadline dl) override;
  // The int8 wire's reduce-scatter: a send to and a receive from every rank (itself included), in
  // one group so that NCCL matches and overlaps them (ncclSend / ncclRecv: NCCL 2.7).
  bool has_alltoall() const override { return api().version >= 20700; }
  void alltoall(const void* send, void* recv, size_t bytes, Stream& s, Deadline dl) override;
  void broadcast(void* buf, size_t bytes, int root, void* user_stream, Deadline dl) override;

  bool can_group() const override { return true; }
  void group_start() override;
  void group_end() override;

  std::unique_ptr<Prober> make_prober(std::function<Position()> mine) override;
  void allgather_host(const void* in, void* out, size_t bytes, Deadline dl) override;
  void broadcast_host(void* buf, size_t bytes, int root, Deadline dl) override;

  void abort() override;
  // ncclCommAbort of this communicator alone (the family aborts its members each on a thread).
  void abort_one();
  void check_async() override;
  void mark_stalled() override;
  std::string who() const override { return format("rank %d of %d", rank_, size_); }
  void scan() override;

  // Elastic contexts, on a communicator made over a Gloo one (ddp_comm_init_nccl_store): the Gloo
  // communicator agrees on the ranks left (or admits joiners) through its store and carries a new
  // NCCL id to them; the old NCCL communicators are aborted, never reused.
  bool can_regroup() const override { return host_ && host_->can_regroup(); }
  // Aborts every sibling and closes the host connections: peers blocked on this rank's prober or
  // control path fail now. A severed communicator's streams fail (check_async), where an abort
  // alone would let them end as if their collectives had completed.
  void sever() override { severer()(); }
  std::function<void()> severer() override;
  Regrouped regroup(const std::string& epoch, int64_t committed,
                    const std::function<std::vector<Liveness>()>& answering, Deadline window, Deadline dl) override;
  std::shared_ptr<JoinDesk> join_desk() override { return can_regroup() ? host_->join_desk() : nullptr; }
  std::unique_ptr<Comm> admit(const std::string& name, const std::vector<int64_t>& slots, const std::string& note,
                              Deadline dl) override;

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
  void in_group(Deadline dl);

  // The NCCL communicator of a membership agreed on (see the second constructor).
  void connect();
  // Flushes a communicator before it is destroyed (ncclCommFinalize, bounded like creation); false
  // if that failed or did not end in time, and the communicator must be aborted instead.
  bool finalize();

  // Throws when the communicator can no longer be used (aborted, or a collective timed out).
  void live() const;
  // The lock every NCCL call on comm_ holds, taken only while the communicator is alive.
  std::unique_lock<std::mutex> hold();

  cudaStream_t collective_stream(Stream& s, Dtype d) const;
  ncclRedOp_t op_for(Reduction red, Dtype d);
  void watch_broadcast(cudaStream_t us, Deadline dl);

  bool host_control() const;
  char* ctrl_buffer(size_t bytes);
  void wait_ctrl(Deadline dl, const char* what);

  struct PreMulOp {
    Dtype dtype;
    double factor;
    ncclRedOp_t op;
  };

  ncclComm_t comm_;  // never used once aborted_
  int device_;
  bool owned_;
  std::unique_ptr<Comm> host_;
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

}  // namespace nccl
}  // namespace ddp
