// A joiner's communicator (gloo_join.hpp): it files its request at the job's desk, waits for the
// answer, and meets the job's members where the answer says.
#include "backends/gloo/gloo_join.hpp"

#include "backends/gloo/gloo_comm.hpp"

namespace ddp {

namespace {

// A joiner's communicator: the store of a running job and nothing else until the job admits it.
class GlooJoiningComm final : public Comm {
 public:
  GlooJoiningComm(std::shared_ptr<GlooWorld> w, std::string lineage)
      : world_(std::move(w)), lineage_(std::move(lineage)) {}
  int rank() const override { return -1; }
  int size() const override { return 0; }
  Memory memory() const override { return Memory::Host; }
  std::unique_ptr<Comm> dup() override { return std::unique_ptr<Comm>(new GlooJoiningComm(world_, lineage_)); }
  std::unique_ptr<Device> make_device() override { return std::unique_ptr<Device>(new HostDevice()); }
  bool supports_wire(Dtype d) const override { return !is_16bit(d); }
  bool supports(RedOp op) const override { return op == RedOp::Sum || op == RedOp::SumScaled; }
  void allreduce(const void*, void*, size_t, Dtype, Reduction, Stream&, Deadline) override { not_admitted(); }
  void broadcast(void*, size_t, int, void*, Deadline) override { not_admitted(); }
  void allgather_host(const void*, void*, size_t, Deadline) override { not_admitted(); }
  void broadcast_host(void*, size_t, int, Deadline) override { not_admitted(); }
  bool can_regroup() const override { return true; }
  bool joining() const override { return true; }
  // Waits for the admission within this communicator's own bound (ddp_comm_join_gloo's timeout_ms),
  // which the request carries so that the job passes over a joiner that stopped waiting.
  JoinOutcome join(const JoinTerms& terms, Deadline dl) override {
    const int64_t bound = world_->init_timeout_ms;
    dl = Deadline::earlier(dl, Deadline::after_ms(bound));
    const JoinRequest request = JoinRequest::of_this_process(terms, bound);
    GlooJoinDesk desk(world_, lineage_);
    JoinOutcome out;
    out.job = world_->rv.describe;
    int64_t slot = 0;
    try {
      do {  // passed over (the job saw its heartbeat stand still): ask again
        slot = desk.file(request, dl);
        out.answer = desk.wait_answer(slot, dl);
      } while (out.answer.kind == JoinAnswer::Kind::PassedOver);
    } catch (const Error& e) {
      if (e.status() != DDP_ERR_TIMEOUT) throw;
      fail(DDP_ERR_TIMEOUT,
           "no running elastic job at %s admitted this process before the timeout (its request waits as '%s'): is "
           "the job running with config.elastic over this rendezvous, and still training? (ranks are admitted "
           "after a synced iteration)",
           world_->rv.describe.c_str(), desk.key(slot).c_str());
    }
    if (out.answer.kind != JoinAnswer::Kind::Admitted) return out;
    // The job waits kJoinArriveMs for its joiners to arrive, then goes on without them if one never
    // came (another joiner of the same admission died): this one then asks again rather than wait out
    // its own bound.
    const Deadline arrive = Deadline::earlier(dl, Deadline::after_ms(kJoinArriveMs + kJoinArriveSlackMs));
    out.comm.reset(new GlooComm(world_, out.answer.meet, arrive, out.answer.rank, out.answer.world, lineage_,
                                out.answer.meet + "/abandoned"));
    return out;
  }

 private:
  [[noreturn]] static void not_admitted() {
    fail(DDP_ERR_INVALID_STATE, "a joiner's communicator has no ranks until the job admits it (ddp_recover)");
  }
  std::shared_ptr<GlooWorld> world_;
  std::string lineage_;
};

}  // namespace

std::unique_ptr<Comm> make_gloo_joining_comm(std::shared_ptr<GlooWorld> w, std::string lineage) {
  return std::unique_ptr<Comm>(new GlooJoiningComm(std::move(w), std::move(lineage)));
}

}  // namespace ddp
