// The context: one DDP instance over one communicator. It holds the config, the registered grads and
// the per-iteration state machine
//
//   OPEN --commit--> IDLE --begin_backward--> IN_BACKWARD --finish_backward--> IDLE
//                      \______________ reduce_all (reduces, stays IDLE) ____/
//
// and turns each API call into work for the planner and the reducer. Every public method is called
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
#include "core/joins.hpp"
#include "core/plan.hpp"
#include "core/reducer.hpp"
#include "core/stragglers.hpp"
#include "core/timeline.hpp"

namespace ddp {

class Context {
 public:
  Context(Comm& comm, const Settings& settings);
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
  // Elastic contexts (elastic.cpp): the membership agreed by the ranks left after a loss, or with the
  // ranks that asked to join (on a joiner: its admission).
  void recover(ddp_membership_t* out, int* members, size_t capacity);

 private:
  enum class State { Open, Idle, InBackward };
  // Throws unless the context can run a call: DDP_ERR_ABORTED, DDP_ERR_RANK_LOST, or on a joiner not
  // yet admitted DDP_ERR_RANK_JOINING (unless `before_admission`: registration, the comm hook).
  void check_alive(bool before_admission = false) const;
  // The communicators, streams and prober over `comm` (ctrl_ made already): at creation and after a
  // recovery.
  void attach(Comm& comm);
  void check_stream_comms();
  // The reducer over the committed registrations, with `plan`.
  void make_reducer(Plan plan);
  // Elastic: the plan the survivors go on with (the new rank 0's).
  std::unique_ptr<Plan> agreed_plan(const Plan* mine, Deadline dl);
  Regrouped agree_members(Deadline window, Deadline dl);
  // `members`: each new rank's number in the communicator the agreement ran over (a loss; none for
  // an admission: the ranks keep their numbers, the joiners come after them).
  void rebuild(std::unique_ptr<Comm> comm, Deadline dl, const std::vector<int>* members = nullptr);
  Deadline membership_deadline() const;
  // The communicators, streams, prober and reducer of the generation that ends, dropped.
  void retire();
  // Elastic joins (elastic.cpp): a joiner's admission; the admission of the joiners the ranks agreed on.
  void join_job(ddp_membership_t* out, int* members, size_t capacity);
  void admit_joiners(ddp_membership_t* out, int* members, size_t capacity);
  // After a rebuild: whose state every rank takes (the first of those that committed the most), and
  // the report of the change. `members`: each new rank's old number (-1: a joiner). The membership
  // reported is the one held from now on.
  void settle_membership(int old_rank, int old_world, std::vector<int> members, const std::vector<int64_t>& committed,
                         ddp_membership_t* out, int* members_out, size_t capacity);
  // The join requests the ranks agreed on in an exchange (the highest slot any rank's watch saw).
  void note_joins(int64_t upto);
  void watch_joins();
  // Elastic: a peer was lost. The context severs its connections (the peers blocked on this rank
  // fail now) and answers DDP_ERR_RANK_LOST until ddp_recover.
  Error lose(const Error& e);
  void confirm_members(Comm& made, Deadline dl);
  // Elastic: this member leaves the job (ddp_destroy); the last one to leave tells the joiners still
  // waiting that the job ended.
  void leave_job();
  // Whether an error of status `st` is taken for a lost peer (elastic contexts): a timeout, an abort
  // (a severed connection), or an NCCL error (NCCL reports a dead peer as a remote or system error).
  bool peer_failure(ddp_status_t st) const {
    return cfg_.c.elastic && !aborted_ && (st == DDP_ERR_TIMEOUT || st == DDP_ERR_ABORTED || st == DDP_ERR_NCCL);
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
  // The stall inspector: where every rank stands, as text for a timeout or a stall warning.
  Position position() const;
  std::string picture(int64_t wait_ms);
  void wire_totals(bool own, uint64_t out[2]) const;
  void stall_warning(int stream);
  // Elastic: while a bucket waits, whether its peers still answer (stall_inspector.cpp).
  static constexpr int64_t kPeerWatchMs = 1000;
  void watch_peers();
  std::vector<int> silent_;  // per rank: peer watches in a row without an answer
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

  std::mutex mu_;
  Settings cfg_;
  std::unique_ptr<Comm> base_;   // elastic: the communicator over the survivors (its dups below)
  std::unique_ptr<Comm> ctrl_;   // agreement and plan broadcast
  std::unique_ptr<Comm> bcast_;  // ddp_broadcast's own channel
  std::vector<std::unique_ptr<Comm>> owned_comms_;
  std::vector<Comm*> comms_;  // one per stream
  std::unique_ptr<Device> device_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::unique_ptr<Timeline> timeline_;
  Stats stats_;        // ddp_get_stats's counters
  Progress progress_;  // where this rank stands, for the stall inspector
  std::vector<GradSpec> specs_;
  std::vector<void*> user_ptrs_;
  ClaimedMemory claimed_;  // the memory the registrations claim (stand-ins claim none)
  size_t total_numel_ = 0;
  ReducerEnv reducer_env_;  // what the reducer reads (declared first: it outlives the reducer)
  std::unique_ptr<Reducer> reducer_;
  PlanLearner learner_;
  State state_ = State::Open;
  bool sync_ = true;
  bool learning_ = false;         // this backward records the plan
  bool iteration_synced_ = true;  // sync setting of the backward in progress
  bool gathered_ = false;         // sharded: parameters gathered since the last reduction
  bool shards_local_ = false;     // sharded: the last backward pass only accumulated (sync off)
  bool aborted_ = false;
  std::string abort_reason_;
  bool lost_ = false;  // elastic: a peer was lost; only ddp_recover goes on
  std::string lost_reason_;
  bool joining_ = false;       // a joiner's context, not yet admitted: registration and ddp_recover only
  int64_t admitted_upto_ = 0;  // elastic: join slots settled (admitted, refused or passed over)
  int64_t pending_upto_ = 0;   // agreed: joiners wait up to this slot; the next iteration answers RANK_JOINING
  std::unique_ptr<JoinWatch> join_watch_;
  uint64_t epoch_ = 0;                 // elastic: membership changes so far
  uint64_t attempts_ = 0;              // elastic: recoveries tried for the next membership
  uint64_t wire_carried_[2] = {0, 0};  // bytes sent and received through communicators since replaced
  int rank_ = 0, world_ = 1;
  uint64_t iterations_ = 0;
  uint64_t exposed_ns_ = 0, last_exposed_ns_ = 0;
  uint64_t layout_epoch_ = 0;
  uint64_t begin_ns_ = 0;
  uint64_t last_ready_ns_ = 0;  // the iteration's last grad_ready
  StragglerWatch stragglers_;
  std::vector<StepTimes> step_times_;
  // After a synced backward pass: every rank's times (with the unused report, or on their own) into
  // the straggler watch.
  void watch_stragglers();
  void* user_stream_ = nullptr;  // ddp_begin_backward's stream: where this iteration's grads come from
  std::vector<int> scratch_unused_;
  std::function<void(const HookCall&)> hook_;
  UnusedReport unused_report_;
  uint64_t wire_base_[2] = {0, 0};  // bytes sent and received through borrowed comms before creation
  int64_t stall_ms_ = 0;            // the stall warning in effect (0: none)
  int64_t warned_iteration_ = -1;   // the iteration whose stall was reported (once per wait)
  // After a rebuild that failed half way: each rank of base_'s number in prober_'s (which is the
  // generation's before); empty: the same numbers.
  std::vector<int> probe_numbers_;
  // Elastic: the membership this rank last held (the last that ddp_create or a ddp_recover that
  // succeeded gave it; -1 and 0 on a joiner), which ddp_recover reports against: a failed attempt may
  // have left base_ over another. held_numbers_: each rank of base_'s number in it (-1: a joiner of
  // a failed admission; empty: the same numbers).
  int held_rank_ = 0, held_world_ = 1;
  std::vector<int> held_numbers_;
  std::shared_ptr<JoinDesk> held_desk_;  // where the members of that membership say they left (leave_job)
  std::unique_ptr<Prober> prober_;       // last member: destroyed first, while what it reads still exists
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
    if (st == DDP_ERR_TIMEOUT && !aborted_) {  // aborted: an inner handler told the picture already
      Error told(st, e.what() + picture(500));
      abort(told);
      throw told;
    }
    abort(e);
    throw;
  }
}

}  // namespace ddp
