#include "core/context.hpp"
#include "core/host_reduce.hpp"

// The context's life cycle, registration, and the collectives outside a backward pass. The backward
// pass itself is in iteration.cpp, the read-only queries in stats.cpp, the stall inspector in stall_inspector.cpp.
#include <algorithm>
#include <exception>
#include <thread>
#include <cstring>

namespace ddp {

// ---------------------------------------------------------------------------------------------
// Life cycle
// ---------------------------------------------------------------------------------------------

Context::Context(Comm& comm, const Settings& settings) : cfg_(settings) {
  if (comm.joining()) {  // a joiner: nothing collective until the job admits it (ddp_recover)
    if (!cfg_.c.elastic)
      fail(DDP_ERR_INVALID_ARGUMENT,
           "a joiner's communicator (ddp_comm_join_gloo) needs config.elastic: only an elastic job admits ranks");
    joining_ = true;
    rank_ = held_rank_ = -1;
    world_ = held_world_ = 0;
    base_ = comm.dup();
    device_ = comm.make_device();
    return;
  }
  rank_ = held_rank_ = comm.rank();
  world_ = held_world_ = comm.size();
  // The duplications below are collective: each waits for every rank, within timeout_ms in all.
  const CreationScope bounded(deadline());
  ctrl_ = comm.dup();
  // Settings that decide how many collectives follow (num_streams) are agreed on before any of them.
  agree_config(*ctrl_, cfg_, deadline());
  if (cfg_.c.elastic && !comm.can_regroup())
    fail(DDP_ERR_UNSUPPORTED,
         "config.elastic needs a communicator that can be rebuilt over the ranks left after a loss: Gloo "
         "(ddp_comm_init_gloo), a local group, or NCCL made over Gloo (ddp_comm_init_nccl_store). MPI cannot "
         "shrink a communicator (it would need ULFM), nor an NCCL communicator made over MPI or borrowed");
  device_ = comm.make_device();
  attach(comm);
  check_stream_comms();
  if (cfg_.c.elastic && (held_desk_ = ctrl_->join_desk()) && rank_ == 0) held_desk_->open(deadline());
  if (cfg_.c.compression != DDP_COMPRESS_NONE && cfg_.c.compression != DDP_COMPRESS_INT8 &&
      comm.memory() == Memory::Device) {
    const Dtype w = cfg_.c.compression == DDP_COMPRESS_FP16 ? Dtype::F16 : Dtype::BF16;
    if (!comm.supports_wire(w))
      fail(DDP_ERR_UNSUPPORTED, "config.compression: this communicator cannot sum %s (NCCL 2.10 or later has bf16)",
           dtype_name(w));
  }
  if (!cfg_.timeline_path.empty()) timeline_.reset(new Timeline(cfg_.timeline_path, rank_, cfg_.c.num_streams));
}

void Context::attach(Comm& comm) {
  rank_ = comm.rank();
  world_ = comm.size();
  prober_ = comm.make_prober([this] { return position(); });
  probe_numbers_.clear();
  bcast_ = comm.dup();
  owned_comms_.clear();
  comms_.clear();
  if (cfg_.stream_comms.empty()) {
    for (int i = 0; i < cfg_.c.num_streams; ++i) {
      owned_comms_.push_back(comm.dup());
      comms_.push_back(owned_comms_.back().get());
    }
  } else {
    comms_ = cfg_.stream_comms;
    wire_totals(false, wire_base_);  // their traffic before this context is not its own
  }
  streams_.clear();
  for (int i = 0; i < cfg_.c.num_streams; ++i) streams_.push_back(device_->make_stream(i));
  stall_ms_ = cfg_.c.stall_warning_ms > 0 ? cfg_.c.stall_warning_ms : 60000;
  if (cfg_.c.timeout_ms > 0 && stall_ms_ >= cfg_.c.timeout_ms) stall_ms_ = 0;  // the timeout comes first
  for (int i = 0; i < cfg_.c.num_streams; ++i)
    streams_[static_cast<size_t>(i)]->set_stall_warning(stall_ms_, [this, i] { stall_warning(i); });
  if (cfg_.c.elastic)
    for (auto& s : streams_) s->set_peer_watch(kPeerWatchMs, [this] { watch_peers(); });
}

// config.stream_comms are the same communicators in the same order on every rank: each carries its
// index, all at once (a thread each), so that communicators given in different orders meet each other
// (and name the difference) rather than wait for each other. Host memory only: device collectives
// issued in different orders on different threads can deadlock in NCCL; there a difference is a
// bucket that times out.
void Context::check_stream_comms() {
  if (cfg_.stream_comms.empty() || world_ == 1 || comms_[0]->memory() != Memory::Host) return;
  const size_t n = comms_.size(), world = static_cast<size_t>(world_);
  std::vector<int32_t> seen(n * world, -1);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  const Deadline dl = deadline();
  for (size_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      try {
        const int32_t mine = static_cast<int32_t>(i);
        comms_[i]->allgather_host(&mine, &seen[i * world], sizeof mine, dl);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < n; ++i)
    for (size_t r = 0; r < world; ++r)
      if (!errors[i] && seen[i * world + r] != static_cast<int32_t>(i))
        fail(DDP_ERR_MISMATCH,
             "config.stream_comms differ between ranks: stream_comms[%zu] of rank %d is stream_comms[%d] of rank %zu; "
             "give every rank the same communicators in the same order",
             i, rank_, seen[i * world + r], r);
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

Context::~Context() {
  join_watch_.reset();
  leave_job();
  set_call(Call::Destroyed);
  // Destroyed in the middle of a backward pass: the launched buckets may be waiting for peers that
  // will never match them. Abort first, so that they (and the peers, where the engine allows) stop.
  // Borrowed stream communicators (config.stream_comms) are the caller's and are left alone.
  if (state_ == State::InBackward && !aborted_ && cfg_.stream_comms.empty())
    abort(Error(DDP_ERR_ABORTED, "destroyed during a backward pass"));
  // Let queued work finish (each collective bounds itself by the timeout) before buffers go away.
  for (auto& s : streams_) {
    try {
      s->drain(Deadline::never());
    } catch (...) {
    }
  }
  // A failed exchange may have left a send posted that the transport still reads on its own thread:
  // that is over before the buffers go away. (Borrowed stream communicators are the caller's.)
  if (aborted_ || lost_) {
    if (cfg_.stream_comms.empty())
      for (Comm* c : comms_) c->drop_posted();
    if (ctrl_) ctrl_->drop_posted();
    if (bcast_) bcast_->drop_posted();
  }
  reducer_.reset();
  streams_.clear();
}

void Context::check_alive(bool before_admission) const {
  if (aborted_)
    fail(DDP_ERR_ABORTED, "the context was aborted by an earlier error and can only be destroyed: %s",
         abort_reason_.c_str());
  if (lost_)
    fail(DDP_ERR_RANK_LOST, "a rank was lost (call ddp_recover before anything else): %s", lost_reason_.c_str());
  if (joining_ && !before_admission)
    fail(DDP_ERR_RANK_JOINING,
         "this context joins a running job (ddp_comm_join_gloo): register the grads, then call ddp_recover to be "
         "admitted, and take the state of membership.source");
}

void Context::abort(const Error& e) {
  if (aborted_) return;
  aborted_ = true;
  abort_reason_ = e.what();
  if (reducer_) reducer_->cancel();
  for (Comm* c : comms_) c->abort();
  if (ctrl_) ctrl_->abort();
  // ddp_broadcast's channel too: the context is over, and a communicator that may share a transport
  // with a written-off worker (Gloo's) is then kept rather than torn down under it.
  if (bcast_) bcast_->abort();
  if (timeline_) timeline_->flush();  // what led here is on disk even if the process never destroys the context
}

void Context::check_index(int index) const {
  if (index < 0 || static_cast<size_t>(index) >= specs_.size())
    fail(DDP_ERR_INVALID_ARGUMENT, "grad index %d out of range (%zu grads registered)", index, specs_.size());
}

// ---------------------------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------------------------

int Context::register_grad(void* grad, size_t numel, Dtype dtype, unsigned flags) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive(true);
  if (state_ != State::Open)
    fail(DDP_ERR_INVALID_STATE,
         "registration is closed (ddp_commit, ddp_grad_ptr, ddp_get_plan or the first "
         "ddp_begin_backward closed it)");
  if (numel == 0) fail(DDP_ERR_INVALID_ARGUMENT, "numel is 0");
  const size_t limit = (SIZE_MAX / 16) / sizeof(double);
  if (numel > limit || total_numel_ > limit - numel)
    fail(DDP_ERR_INVALID_ARGUMENT, "numel %zu is too large (the grads together may hold at most %zu elements)", numel,
         limit);
  const unsigned known = DDP_GRAD_TRIGGER | DDP_GRAD_STAND_IN;
  if ((flags & ~known) != 0) fail(DDP_ERR_INVALID_ARGUMENT, "unknown flags 0x%x", flags & ~known);
  const bool stand_in = (flags & DDP_GRAD_STAND_IN) != 0;
  if (stand_in && cfg_.arena())
    fail(DDP_ERR_INVALID_ARGUMENT, "DDP_GRAD_STAND_IN is for the copy layout (the arena layout takes no pointer)");
  if (cfg_.arena() && grad)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "in the arena layout the library owns grad storage: pass NULL and ask "
         "ddp_grad_ptr where the grad lives");
  if (!cfg_.arena() && !grad) fail(DDP_ERR_INVALID_ARGUMENT, "grad is NULL (the copy layout needs the user's buffer)");
  if (specs_.size() >= static_cast<size_t>(INT32_MAX)) fail(DDP_ERR_INVALID_ARGUMENT, "too many grads");
  check_grad_aligned(grad, dtype, static_cast<int>(specs_.size()));
  if (!stand_in) claimed_.claim(static_cast<int>(specs_.size()), grad, numel, dtype);
  // The stand-in flag is this rank's business: the grad's spec (agreed, planned) carries the rest.
  specs_.push_back(GradSpec{numel, dtype, flags & ~DDP_GRAD_STAND_IN});
  user_ptrs_.push_back(grad);
  total_numel_ += numel;
  return static_cast<int>(specs_.size() - 1);
}

void Context::commit() {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  commit_locked();
}

void Context::commit_locked() {
  if (state_ != State::Open) return;
  CallScope scope(this, Call::Commit);
  progress_.calls.fetch_add(1, std::memory_order_relaxed);  // the stall inspector: who never got here
  try {
    agree_registration(*ctrl_, specs_, static_cast<bool>(hook_), deadline());
    make_reducer(registration_plan(specs_, cfg_.c.message_size, cfg_.c.num_streams));
    learner_.reset(specs_.size());
    scratch_unused_.reserve(specs_.size());
    state_ = State::Idle;
    log_plan();
  } catch (const Error& e) {
    // Ranks disagree, one did not come, or a buffer could not be had: nothing sensible can follow.
    // A timeout says who did not come (the stall inspector's picture), as a backward pass's does.
    // An elastic context that lost a rank here commits again over the survivors after ddp_recover.
    if (peer_failure(e.status())) {
      reducer_.reset();
      throw lose(e);
    }
    if (e.status() != DDP_ERR_TIMEOUT) {
      abort(e);
      throw;
    }
    Error told(e.status(), e.what() + picture(500));
    abort(told);
    throw told;
  }
}

void Context::make_reducer(Plan plan) {
  // The reducer's settings and backend objects, owned here for the reducer's life.
  ReducerEnv& env = reducer_env_;
  env.device = device_.get();
  env.comms = comms_;
  env.streams.clear();
  for (auto& s : streams_) env.streams.push_back(s.get());
  env.program = cfg_.program(world_, rank_, static_cast<bool>(hook_));
  env.check_finite = (cfg_.c.check_finite != 0);
  env.timeout_ms = cfg_.c.timeout_ms;
  env.hook = hook_;
  env.stats = &stats_;
  env.progress = &progress_;
  env.timeline = timeline_.get();
  env.on_failure = nullptr;
  if (cfg_.c.elastic) {
    std::vector<std::function<void()>> cut;
    for (Comm* c : comms_) cut.push_back(c->severer());
    cut.push_back(ctrl_->severer());
    cut.push_back(bcast_->severer());
    env.on_failure = [cut] {
      for (const auto& f : cut) f();
    };
  }
  reducer_.reset(new Reducer(env, specs_));
  reducer_->adopt(std::move(plan), user_ptrs_);
  if (cfg_.c.elastic) watch_joins();
}

void* Context::grad_ptr(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  check_index(index);
  if (!cfg_.arena()) return user_ptrs_[static_cast<size_t>(index)];
  commit_locked();
  return reducer_->grad_ptr(index);
}

void Context::set_grad_ptr(int index, void* grad) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  check_index(index);
  if (cfg_.arena()) fail(DDP_ERR_INVALID_STATE, "in the arena layout the library owns grad storage");
  if (!grad) fail(DDP_ERR_INVALID_ARGUMENT, "grad is NULL");
  check_grad_aligned(grad, specs_[static_cast<size_t>(index)].dtype, index);
  if (state_ == State::InBackward && reducer_->is_ready(index))
    fail(DDP_ERR_INVALID_STATE, "grad %d is already marked ready in this backward pass", index);
  user_ptrs_[static_cast<size_t>(index)] = grad;
  if (reducer_) reducer_->set_grad_ptr(index, grad);
}

// ---------------------------------------------------------------------------------------------
// Collectives outside the backward pass
// ---------------------------------------------------------------------------------------------

void Context::broadcast(void* const* buffers, const size_t* counts, const ddp_dtype_t* dtypes, int n, int root,
                        void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (n < 0) fail(DDP_ERR_INVALID_ARGUMENT, "n is %d", n);
  if (n > 0 && (!buffers || !counts || !dtypes))
    fail(DDP_ERR_INVALID_ARGUMENT, "buffers, counts and dtypes must not be NULL");
  if (root < 0 || root >= world_) fail(DDP_ERR_INVALID_ARGUMENT, "root %d out of range 0..%d", root, world_ - 1);
  for (int i = 0; i < n; ++i) {
    if (!host_dtype_valid(enum_value(dtypes[i])))  // bytes on the wire: integers travel too
      fail(DDP_ERR_INVALID_ARGUMENT, "dtypes[%d] is %d, not a ddp_dtype_t (DDP_F16..DDP_F64, DDP_I32, DDP_I64)", i,
           enum_value(dtypes[i]));
    if (counts[i] > 0 && !buffers[i]) fail(DDP_ERR_INVALID_ARGUMENT, "buffers[%d] is NULL", i);
    if (counts[i] > SIZE_MAX / 16) fail(DDP_ERR_INVALID_ARGUMENT, "counts[%d] is too large", i);
  }
  CallScope scope(this, Call::Broadcast);
  fatal_on_error([&] {
    if (world_ > 1) agree_broadcast(counts, dtypes, n, root);
    for (int i = 0; i < n; ++i)
      if (counts[i])
        bcast_->broadcast(buffers[i], counts[i] * host_dtype_size(enum_value(dtypes[i])), root, stream, deadline());
  });
}

void Context::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  fatal_on_error([&] {
    for (auto& s : streams_) s->drain(Deadline::never());
  });
}

}  // namespace ddp
