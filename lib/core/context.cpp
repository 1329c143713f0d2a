// The context's life cycle, registration, and the collectives outside a backward pass. The backward
// pass itself is in iteration.cpp, the read-only queries in stats.cpp, the stall inspector in
// stall_inspector.cpp, elastic membership in recovery.cpp and admission.cpp.
#include "core/context.hpp"

#include <algorithm>
#include <cstring>
#include <exception>

#include "core/host_reduce.hpp"

namespace ddp {

// ---------------------------------------------------------------------------------------------
// Life cycle
// ---------------------------------------------------------------------------------------------

Context::Context(Comm& comm, const Settings& settings, std::vector<Comm*> stream_comms)
    : cfg_(settings), stream_comms_(std::move(stream_comms)) {
  if (comm.joining()) {  // a joiner: nothing collective until the job admits it (ddp_recover)
    if (!cfg_.c.elastic)
      fail(DDP_ERR_INVALID_ARGUMENT,
           "a joiner's communicator (ddp_comm_join_gloo) needs config.elastic: only an elastic job admits ranks");
    health_.joining = true;
    book_.held_rank = -1;
    book_.held_world = 0;
    joiner_ = comm.dup();
    device_ = comm.make_device();
    return;
  }
  book_.held_rank = comm.rank();
  book_.held_world = comm.size();
  // The duplications below are collective: each waits for every rank, within timeout_ms in all.
  const CreationScope bounded(deadline());
  gen_.reset(new Generation(comm, nullptr, comm.dup()));
  // Settings that decide how many collectives follow (num_streams) are agreed on before any of them.
  agree_config(ctrl(), cfg_, deadline());
  if (cfg_.c.elastic && !comm.can_regroup())
    fail(DDP_ERR_UNSUPPORTED,
         "config.elastic needs a communicator that can be rebuilt over the ranks left after a loss: Gloo "
         "(ddp_comm_init_gloo), a local group, or NCCL made over Gloo (ddp_comm_init_nccl_store). MPI cannot "
         "shrink a communicator (it would need ULFM), nor an NCCL communicator made over MPI or borrowed");
  device_ = comm.make_device();
  gen_->stand_up(cfg_, stream_comms_, *device_, hooks());
  if (!stream_comms_.empty()) gen_->wire_totals(false, wire_base_);  // their traffic before this context
  gen_->check_stream_comms(!stream_comms_.empty(), deadline());
  if (cfg_.c.elastic && (book_.held_desk = ctrl().join_desk()) && rank() == 0) book_.held_desk->open(deadline());
  if (cfg_.c.compression != DDP_COMPRESS_NONE && cfg_.c.compression != DDP_COMPRESS_INT8 &&
      comm.memory() == Memory::Device) {
    const Dtype w = cfg_.c.compression == DDP_COMPRESS_FP16 ? Dtype::F16 : Dtype::BF16;
    if (!comm.supports_wire(w))
      fail(DDP_ERR_UNSUPPORTED, "config.compression: this communicator cannot sum %s (NCCL 2.10 or later has bf16)",
           dtype_name(w));
  }
  if (!cfg_.timeline_path.empty()) timeline_.reset(new Timeline(cfg_.timeline_path, rank(), cfg_.c.num_streams));
}

Generation::Hooks Context::hooks() {
  Generation::Hooks h;
  h.position = [this] { return position(); };
  h.stall = [this](int stream) { stall_warning(stream); };
  return h;
}

Context::~Context() {
  if (gen_) gen_->stop_join_watch();
  leave_job();
  set_call(Call::Destroyed);
  if (!gen_) return;
  // Destroyed in the middle of a backward pass: the launched buckets may be waiting for peers that
  // will never match them. Abort first, so that they (and the peers, where the engine allows) stop.
  // Borrowed stream communicators (config.stream_comms) are the caller's and are left alone.
  if (pass_.state == State::InBackward && !health_.aborted && stream_comms_.empty())
    abort(Error(DDP_ERR_ABORTED, "destroyed during a backward pass"));
  // Let queued work finish (each collective bounds itself by the timeout) before buffers go away.
  gen_->drain(Deadline::never());
  // A failed exchange may have left a send posted that the transport still reads on its own thread:
  // that is over before the buffers go away. (Borrowed stream communicators are the caller's.)
  if (health_.aborted || health_.lost) gen_->drop_posted(stream_comms_.empty());
  gen_.reset();
}

void Context::check_alive(bool before_admission) const {
  if (health_.aborted)
    fail(DDP_ERR_ABORTED, "the context was aborted by an earlier error and can only be destroyed: %s",
         health_.abort_reason.c_str());
  if (health_.lost)
    fail(DDP_ERR_RANK_LOST, "a rank was lost (call ddp_recover before anything else): %s", health_.lost_reason.c_str());
  if (health_.joining && !before_admission)
    fail(DDP_ERR_RANK_JOINING,
         "this context joins a running job (ddp_comm_join_gloo): register the grads, then call ddp_recover to be "
         "admitted, and take the state of membership.source");
}

void Context::abort(const Error& e) {
  if (health_.aborted) return;
  health_.aborted = true;
  health_.abort_reason = e.what();
  if (gen_) gen_->abort();
  if (timeline_) timeline_->flush();  // what led here is on disk even if the process never destroys the context
}

void Context::check_index(int index) const {
  if (index < 0 || static_cast<size_t>(index) >= regs_.specs.size())
    fail(DDP_ERR_INVALID_ARGUMENT, "grad index %d out of range (%zu grads registered)", index, regs_.specs.size());
}

// ---------------------------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------------------------

int Context::register_grad(void* grad, size_t numel, Dtype dtype, unsigned flags) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive(true);
  if (pass_.state != State::Open)
    fail(DDP_ERR_INVALID_STATE,
         "registration is closed (ddp_commit, ddp_grad_ptr, ddp_get_plan or the first "
         "ddp_begin_backward closed it)");
  if (numel == 0) fail(DDP_ERR_INVALID_ARGUMENT, "numel is 0");
  const size_t limit = (SIZE_MAX / 16) / sizeof(double);
  if (numel > limit || regs_.total_numel > limit - numel)
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
  if (regs_.specs.size() >= static_cast<size_t>(INT32_MAX)) fail(DDP_ERR_INVALID_ARGUMENT, "too many grads");
  check_grad_aligned(grad, dtype, static_cast<int>(regs_.specs.size()));
  if (!stand_in) regs_.claimed.claim(static_cast<int>(regs_.specs.size()), grad, numel, dtype);
  // The stand-in flag is this rank's business: the grad's spec (agreed, planned) carries the rest.
  regs_.specs.push_back(GradSpec{numel, dtype, flags & ~DDP_GRAD_STAND_IN});
  regs_.user_ptrs.push_back(grad);
  regs_.total_numel += numel;
  return static_cast<int>(regs_.specs.size() - 1);
}

void Context::commit() {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  commit_locked();
}

void Context::commit_locked() {
  if (pass_.state != State::Open) return;
  CallScope scope(this, Call::Commit);
  progress_.calls.fetch_add(1, std::memory_order_relaxed);  // the stall inspector: who never got here
  try {
    agree_registration(ctrl(), regs_.specs, static_cast<bool>(hook_), deadline());
    make_reducer(registration_plan(regs_.specs, cfg_.c.message_size, cfg_.c.num_streams));
    learner_.reset(regs_.specs.size());
    pass_.unused.reserve(regs_.specs.size());
    pass_.state = State::Idle;
    log_plan();
  } catch (const Error& e) {
    // Ranks disagree, one did not come, or a buffer could not be had: nothing sensible can follow.
    // A timeout says who did not come (the stall inspector's picture), as a backward pass's does.
    // An elastic context that lost a rank here commits again over the survivors after ddp_recover.
    if (peer_failure(e.status())) {
      gen_->drop_reducer();
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
  env.program = program_settings(cfg_, world(), rank(), static_cast<bool>(hook_));
  env.check_finite = (cfg_.c.check_finite != 0);
  env.timeout_ms = cfg_.c.timeout_ms;
  env.hook = hook_;
  env.stats = &stats_;
  env.progress = &progress_;
  env.timeline = timeline_.get();
  env.on_failure = cfg_.c.elastic ? gen_->severer() : nullptr;
  gen_->make_reducer(env, regs_.specs, std::move(plan), regs_.user_ptrs);
  if (cfg_.c.elastic) watch_joins();
}

void* Context::grad_ptr(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  check_index(index);
  if (!cfg_.arena()) return regs_.user_ptrs[static_cast<size_t>(index)];
  commit_locked();
  return reducer().grad_ptr(index);
}

void Context::set_grad_ptr(int index, void* grad) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  check_index(index);
  if (cfg_.arena()) fail(DDP_ERR_INVALID_STATE, "in the arena layout the library owns grad storage");
  if (!grad) fail(DDP_ERR_INVALID_ARGUMENT, "grad is NULL");
  check_grad_aligned(grad, regs_.specs[static_cast<size_t>(index)].dtype, index);
  if (pass_.state == State::InBackward && reducer().is_ready(index))
    fail(DDP_ERR_INVALID_STATE, "grad %d is already marked ready in this backward pass", index);
  regs_.user_ptrs[static_cast<size_t>(index)] = grad;
  if (gen_ && gen_->reducer()) gen_->reducer()->set_grad_ptr(index, grad);
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
  if (root < 0 || root >= world()) fail(DDP_ERR_INVALID_ARGUMENT, "root %d out of range 0..%d", root, world() - 1);
  for (int i = 0; i < n; ++i) {
    if (!host_dtype_valid(enum_value(dtypes[i])))  // bytes on the wire: integers travel too
      fail(DDP_ERR_INVALID_ARGUMENT, "dtypes[%d] is %d, not a ddp_dtype_t (DDP_F16..DDP_F64, DDP_I32, DDP_I64)", i,
           enum_value(dtypes[i]));
    if (counts[i] > 0 && !buffers[i]) fail(DDP_ERR_INVALID_ARGUMENT, "buffers[%d] is NULL", i);
    if (counts[i] > SIZE_MAX / 16) fail(DDP_ERR_INVALID_ARGUMENT, "counts[%d] is too large", i);
  }
  CallScope scope(this, Call::Broadcast);
  fatal_on_error([&] {
    if (world() > 1) agree_broadcast(counts, dtypes, n, root);
    for (int i = 0; i < n; ++i)
      if (counts[i])
        gen_->bcast().broadcast(buffers[i], counts[i] * host_dtype_size(enum_value(dtypes[i])), root, stream,
                                deadline());
  });
}

void Context::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  fatal_on_error([&] {
    for (auto& s : gen_->streams()) s->drain(Deadline::never());
  });
}

}  // namespace ddp
