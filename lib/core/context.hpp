// The context: one DDP instance over one communicator. It holds the config, the registered grads and
// the per-iteration state machine
//
//   OPEN --commit--> IDLE --begin_backward--> IN_BACKWARD --finish_backward--> IDLE
//                      \______________ reduce_all (reduces, stays IDLE) ____/
//
// and turns each API call into work for the planner and the reducer. What outlives a membership is
// here (the config, the registrations, the statistics, the caller's hook); what belongs to one is the
// current Generation (core/generation.hpp), which ddp_recover replaces. Every public method is called
// by the C shell with the context's lock held by this class itself.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/agreement.hpp"
#include "core/backend.hpp"
#include "core/config.hpp"
#include "core/elastic.hpp"
#include "core/generation.hpp"
#include "core/plan.hpp"
#include "core/reducer.hpp"
#include "core/stragglers.hpp"
#include "core/timeline.hpp"

namespace ddp {

class Context {
 public:
  // Over `comm`, with `stream_comms` (config.stream_comms, borrowed; empty: the context's own).
  Context(Comm& comm, const Settings& settings, std::vector<Comm*> stream_comms);
  ~Context();

  int register_grad(void* grad, size_t numel, Dtype dtype, unsigned flags);
  void commit();
  void* grad_ptr(int index);
  void set_grad_ptr(int index, void* grad);
  void begin_backward(void* stream);
  void grad_ready(int index, void* grad);
  void finish_backward(void* stream);
  // Whether grad `index`'s reduced value can be had before ddp_finish_backward; if so, waits for it.
  bool wait_grad(int index, void* stream);
  void set_sync(bool enabled);
  void reduce_all(void* stream);
  void broadcast(void* const* buffers, const size_t* counts, const ddp_dtype_t* dtypes, int n, int root, void* stream);
  void synchronize();
  void stats(ddp_stats_t* out);
  void plan_info(int* num_buckets, int* learned);
  void bucket_info(int bucket, ddp_bucket_info_t* info, int* grads, size_t capacity);
  // Sharded contexts (sharding.cpp).
  void shard_info(int bucket, ddp_shard_info_t* info);
  void grad_shard(int index, size_t* first, size_t* count, size_t* shard_pos);
  void* param_ptr(int index);
  void broadcast_params(int root, void* stream);
  void gather_params(void* stream);
  void wait_params(int index, void* stream);
  void shard_norm(void* stream, double* norm, uint64_t* nonfinite);
  // Uneven inputs and the control-path collectives (collectives.cpp).
  uint64_t join();
  void allreduce_host(void* buf, size_t count, int dtype, int op);
  void barrier();
  // A comm hook (empty: none). Before the first backward pass.
  void set_comm_hook(std::function<void(const HookCall&)> hook);
  // Elastic contexts (recovery.cpp): the membership agreed by the ranks left after a loss, or with
  // the ranks that asked to join (admission.cpp; on a joiner: its admission).
  void recover(ddp_membership_t* out, int* members, size_t capacity);

 private:
  enum class State { Open, Idle, InBackward };
  // Where the iterations stand: the state machine above and what the backward pass in progress keeps.
  struct Pass {
    State state = State::Open;
    bool sync = true;                          // ddp_set_sync
    bool learning = false;                     // this backward records the plan
    bool synced = true;                        // the sync setting of the backward in progress
    bool gathered = false;                     // sharded: parameters gathered since the last reduction
    bool shards_local = false;                 // sharded: the last backward pass only accumulated (sync off)
    uint64_t iterations = 0;                   // synced iterations committed
    uint64_t begin_ns = 0, last_ready_ns = 0;  // the iteration's begin and its last grad_ready
    uint64_t exposed_ns = 0, last_exposed_ns = 0;
    uint64_t layout_epoch = 0;    // the arena's grads moved (a learned plan adopted, a rebuild)
    void* user_stream = nullptr;  // ddp_begin_backward's stream: where this iteration's grads come from
    std::vector<int> unused;      // scratch: the grads not marked ready
  };
  // Whether the context can go on.
  struct Health {
    bool aborted = false;  // only ddp_destroy is left
    std::string abort_reason;
    bool lost = false;  // elastic: a peer was lost; only ddp_recover goes on
    std::string lost_reason;
    bool joining = false;  // a joiner's context, not yet admitted: registration and ddp_recover only
  };
  // The registered grads (alike on every rank once committed).
  struct Registrations {
    std::vector<GradSpec> specs;
    std::vector<void*> user_ptrs;  // the caller's storage (copy layout)
    ClaimedMemory claimed;         // the memory they claim (stand-ins claim none)
    size_t total_numel = 0;
  };

  // Throws unless the context can run a call: DDP_ERR_ABORTED, DDP_ERR_RANK_LOST, or on a joiner not
  // yet admitted DDP_ERR_RANK_JOINING (unless `before_admission`: registration, the comm hook).
  void check_alive(bool before_admission = false) const;
  int rank() const { return gen_ ? gen_->rank() : -1; }
  int world() const { return gen_ ? gen_->world() : 0; }
  Reducer& reducer() const { return *gen_->reducer(); }
  Comm& ctrl() const { return gen_->ctrl(); }
  Generation::Hooks hooks();
  // The reducer over the committed registrations, with `plan`.
  void make_reducer(Plan plan);
  // Elastic (recovery.cpp): the next generation over `comm` (the membership agreed on, or admitted)
  // swapped in for the current one, with the reducer over the plan the members agree on. `members`:
  // each new rank's number in the current generation (none: an admission, the ranks keep their
  // numbers and the joiners come after them).
  void next_generation(std::unique_ptr<Comm> comm, Deadline dl, const std::vector<int>* members = nullptr);
  // After a change: whose state every rank takes (the first of those that committed the most), and
  // the report of the change (`members`: each new rank's number in the membership held before, -1: a
  // joiner; `committed` empty: no change after all), which becomes the membership held.
  void settle_membership(int old_rank, int old_world, std::vector<int> members, const std::vector<int64_t>& committed,
                         ddp_membership_t* out, int* members_out, size_t capacity);
  // Elastic joins (admission.cpp): a joiner's admission; the admission of the joiners the ranks agreed on.
  void join_job(ddp_membership_t* out, int* members, size_t capacity);
  void admit_joiners(ddp_membership_t* out, int* members, size_t capacity);
  void watch_joins();
  // Elastic: a peer was lost. The context severs its connections (the peers blocked on this rank
  // fail now) and answers DDP_ERR_RANK_LOST until ddp_recover.
  Error lose(const Error& e);
  // Elastic: this member leaves the job (ddp_destroy); the last one to leave tells the joiners still
  // waiting that the job ended.
  void leave_job();
  // Whether an error of status `st` is taken for a lost peer (elastic contexts): a timeout, an abort
  // (a severed connection), or an NCCL error (NCCL reports a dead peer as a remote or system error).
  bool peer_failure(ddp_status_t st) const {
    return cfg_.c.elastic && !health_.aborted && (st == DDP_ERR_TIMEOUT || st == DDP_ERR_ABORTED || st == DDP_ERR_NCCL);
  }
  // When a collective started now must have completed.
  Deadline deadline() const { return Deadline::after_ms(cfg_.c.timeout_ms); }
  void commit_locked();
  void check_index(int index) const;
  void learn_plan();
  void wait_buckets(void* stream);
  // Runs `fn`; a fatal error (timeout, failed collective) aborts the context before it propagates.
  // A timeout's message gets the stall inspector's picture first.
  template <class F>
  void fatal_on_error(F&& fn);
  // The stall inspector (stall_inspector.cpp): where every rank stands, as text for a timeout or a
  // stall warning.
  Position position() const;
  std::string picture(int64_t wait_ms);
  void stall_warning(int stream);
  // Bytes sent and received through every communicator of every generation (and, with `own`, the
  // control path and ddp_broadcast's channel), since this context was made.
  void wire_totals(bool own, uint64_t out[2]) const;
  void set_call(Call c) { progress_.call.store(static_cast<int32_t>(c), std::memory_order_relaxed); }
  // Sets the call a rank reports itself in for a scope; restores `after` (default: the one before).
  class CallScope {
   public:
    CallScope(Context* c, Call now) : c_(c), after_(c->progress_.call.load(std::memory_order_relaxed)) {
      c_->set_call(now);
    }
    CallScope(Context* c, Call now, Call after) : CallScope(c, now) { after_ = static_cast<int32_t>(after); }
    ~CallScope() { c_->progress_.call.store(after_, std::memory_order_relaxed); }

   private:
    Context* c_;
    int32_t after_;
  };
  void log_plan();
  void log_summary();
  const Plan& committed_plan();
  void abort(const Error& e);
  void check_sharded() const;
  // What a rank is doing on the control path (a CallRecord), sent before the call's data: ranks
  // that called different things fail with DDP_ERR_MISMATCH instead of mixing their bytes.
  // `compare_count` false: the records' counts may differ (the caller compares them itself).
  std::vector<CallRecord> exchange_call(const CallRecord& mine, bool compare_count = true);
  // ddp_broadcast's arguments are the same on every rank (n, root, and each buffer's count and dtype),
  // or every rank fails with DDP_ERR_MISMATCH naming the first buffer that differs.
  void agree_broadcast(const size_t* counts, const ddp_dtype_t* dtypes, int n, int root);
  // Uneven inputs: says whether this rank contributes to the synced iteration that starts (and which
  // kind: a backward pass or ddp_reduce_all; a joined rank says kShadow), and returns how many ranks
  // contribute (the averages' divisor follows) and, in *kind, what they are running.
  enum : int32_t { kBackwardPass = 0, kReduceAll = 1, kShadow = 2 };
  int vote(int32_t kind, int32_t* theirs = nullptr);
  // One of the others' synced iterations of `kind`, every grad of this rank a zero contribution.
  void shadow_iteration(int32_t kind);
  // A reduction finished (or, with sync off, a backward pass only accumulated): what gathers may follow.
  void shards_reduced(bool synced);
  // After a synced backward pass: every rank's times (with the iteration report, or on their own) into
  // the straggler watch.
  void watch_stragglers();

  std::mutex mu_;
  Settings cfg_;
  std::vector<Comm*> stream_comms_;  // config.stream_comms: the caller's, borrowed (empty: the context's own)
  std::unique_ptr<Device> device_;
  std::unique_ptr<Timeline> timeline_;
  Stats stats_;        // ddp_get_stats's counters
  Progress progress_;  // where this rank stands, for the stall inspector
  Registrations regs_;
  PlanLearner learner_;
  Pass pass_;
  Health health_;
  MembershipBook book_;  // elastic
  std::function<void(const HookCall&)> hook_;
  IterationReport report_;
  StragglerWatch stragglers_;
  std::vector<StepTimes> step_times_;
  uint64_t wire_carried_[2] = {0, 0};  // bytes sent and received through generations since retired
  uint64_t wire_base_[2] = {0, 0};     // bytes sent and received through borrowed comms before creation
  int64_t warned_iteration_ = -1;      // the iteration whose stall was reported (once per wait)
  std::unique_ptr<Comm> joiner_;       // a joiner's communicator, until the job admits it
  ReducerEnv reducer_env_;             // what the current generation's reducer reads (outlives every generation)
  std::unique_ptr<Generation> gen_;    // the current membership's communicators, streams and reducer
};

template <class F>
void Context::fatal_on_error(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    const ddp_status_t st = e.status();
    if (st == DDP_ERR_INVALID_ARGUMENT || st == DDP_ERR_INVALID_STATE || st == DDP_ERR_UNSUPPORTED ||
        st == DDP_ERR_RANK_LOST)
      throw;  // the call was refused (the context is intact), or the loss is handled already
    // A peer that died, was cut off or stalled (a failed exchange): an elastic context goes on.
    if (peer_failure(st)) throw lose(e);
    if (st == DDP_ERR_TIMEOUT && !health_.aborted) {  // aborted: an inner handler told the picture already
      Error told(st, e.what() + picture(500));
      abort(told);
      throw told;
    }
    abort(e);
    throw;
  }
}

}  // namespace ddp
