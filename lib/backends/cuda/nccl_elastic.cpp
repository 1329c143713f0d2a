// The NCCL communicator's elastic paths, on one made over a Gloo communicator
// (ddp_comm_init_nccl_store): the Gloo communicator agrees on a membership (ranks lost, joiners
// admitted) and carries the new NCCL id; the NCCL communicator of a membership is made at its first
// duplication. And the joiner's side (ddp_comm_join_nccl).
#include "backends/cuda/nccl_comm.hpp"

#include <cstring>

#include "backends/cuda/cuda_device.hpp"
#include "core/comms.hpp"

namespace ddp {
namespace nccl {

NcclComm::NcclComm(std::unique_ptr<Comm> host, int device, int64_t timeout_ms)
    : comm_(nullptr), device_(device), owned_(true), host_(std::move(host)), timeout_ms_(timeout_ms) {
  rank_ = host_->rank();
  size_ = host_->size();
  watchdog_register(this);
}

std::function<void()> NcclComm::severer() {
  std::function<void()> host = host_ ? host_->severer() : std::function<void()>([] {});
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

Regrouped NcclComm::regroup(const std::string& epoch, int64_t committed,
                            const std::function<std::vector<Liveness>()>& answering, Deadline window, Deadline dl) {
  if (!can_regroup())
    fail(DDP_ERR_UNSUPPORTED,
         "this NCCL communicator cannot be rebuilt over fewer ranks: only one made over a Gloo store "
         "(ddp_comm_init_nccl_store) can");
  Regrouped g = host_->regroup(epoch, committed, answering, window, dl);
  g.comm.reset(new NcclComm(std::move(g.comm), device_, timeout_ms_));
  return g;
}

// The new membership's Gloo communicator first (the joiners meet it in their join), then an NCCL
// communicator over it, made the same way on the joiners (NcclJoiningComm::join).
std::unique_ptr<Comm> NcclComm::admit(const std::string& name, const std::vector<int64_t>& slots,
                                      const std::string& note, Deadline dl) {
  if (!can_regroup()) return Comm::admit(name, slots, note, dl);
  return std::unique_ptr<Comm>(new NcclComm(host_->admit(name, slots, note, dl), device_, timeout_ms_));
}
// The NCCL communicator of a membership agreed on (see the second constructor): the id made by
// rank 0 and sent over the host communicator, within the creation's bound (ddp_recover's).
void NcclComm::connect() {
  const Deadline dl = Deadline::earlier(creation_deadline(), Deadline::after_ms(timeout_ms_));
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (rank_ == 0) {
    DeviceGuard g(device_);
    DDP_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
  }
  host_->broadcast_host(&id, sizeof id, 0, dl);
  DeviceGuard g(device_);
  ncclComm_t c = init_rank(id, size_, rank_, ms_left(dl));
  std::lock_guard<std::mutex> lock(mu_);
  comm_ = c;
}

namespace {

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
  JoinOutcome join(const JoinTerms& terms, Deadline dl) override {
    JoinOutcome out = host_->join(terms, dl);
    if (out.comm) out.comm = make_nccl_pending(std::move(out.comm), device_, timeout_ms_);
    return out;
  }

 private:
  std::unique_ptr<Comm> host_;
  int device_;
  int64_t timeout_ms_;
};

}  // namespace

}  // namespace nccl

std::unique_ptr<Comm> make_nccl_join_comm(const char* init_method, int cuda_device, int64_t timeout_ms) {
  require_cuda_device(cuda_device);
  return std::unique_ptr<Comm>(
      new nccl::NcclJoiningComm(make_gloo_join_comm(init_method, timeout_ms), cuda_device, timeout_ms));
}

}  // namespace ddp
