#include "core/context.hpp"

#include <algorithm>

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace ddp {

// ---------------------------------------------------------------------------------------------
// Life cycle
// ---------------------------------------------------------------------------------------------

Context::Context(Comm& comm, const Settings& settings) : cfg_(settings) {
  rank_ = comm.rank();
  world_ = comm.size();
  ctrl_ = comm.dup();
  // Settings that decide how many collectives follow (num_streams) are agreed on before any of them.
  agree_config(*ctrl_, cfg_, deadline());
  bcast_ = comm.dup();
  if (cfg_.stream_comms.empty()) {
    for (int i = 0; i < cfg_.c.num_streams; ++i) {
      owned_comms_.push_back(comm.dup());
      comms_.push_back(owned_comms_.back().get());
    }
  } else {
    comms_ = cfg_.stream_comms;
  }
  device_ = comm.make_device();
  for (int i = 0; i < cfg_.c.num_streams; ++i) streams_.push_back(device_->make_stream(i));
  if (!cfg_.timeline_path.empty()) timeline_.reset(new Timeline(cfg_.timeline_path, rank_));
}

Context::~Context() {
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
  reducer_.reset();
  streams_.clear();
}

void Context::check_alive() const {
  if (aborted_)
    fail(DDP_ERR_ABORTED, "the context was aborted by an earlier error and can only be destroyed: %s",
         abort_reason_.c_str());
}

void Context::abort(const Error& e) {
  if (aborted_) return;
  aborted_ = true;
  abort_reason_ = e.what();
  if (reducer_) reducer_->cancel();
  for (Comm* c : comms_) c->abort();
  ctrl_->abort();
}

template <class F>
void Context::fatal_on_error(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    switch (e.status()) {
      case DDP_ERR_INVALID_ARGUMENT:
      case DDP_ERR_INVALID_STATE:
      case DDP_ERR_UNSUPPORTED:
        break;  // the call was refused; the context is intact
      default:
        abort(e);
    }
    throw;
  }
}

void Context::check_index(int index, const char* fn) const {
  if (index < 0 || static_cast<size_t>(index) >= specs_.size())
    fail(DDP_ERR_INVALID_ARGUMENT, "%s: grad index %d out of range (%zu grads registered)", fn, index,
         specs_.size());
}

// ---------------------------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------------------------

int Context::register_grad(void* grad, size_t numel, Dtype dtype, unsigned flags) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (state_ != State::Open)
    fail(DDP_ERR_INVALID_STATE,
         "ddp_register_grad: registration is closed (ddp_commit, ddp_grad_ptr, ddp_get_plan or the first "
         "ddp_begin_backward closed it)");
  if (numel == 0) fail(DDP_ERR_INVALID_ARGUMENT, "ddp_register_grad: numel is 0");
  const size_t limit = (SIZE_MAX / 16) / sizeof(double);
  if (numel > limit || total_numel_ > limit - numel)
    fail(DDP_ERR_INVALID_ARGUMENT, "ddp_register_grad: numel %zu is too large (the grads together may hold at most %zu elements)",
         numel, limit);
  if ((flags & ~DDP_GRAD_TRIGGER) != 0)
    fail(DDP_ERR_INVALID_ARGUMENT, "ddp_register_grad: unknown flags 0x%x", flags & ~DDP_GRAD_TRIGGER);
  if (cfg_.arena() && grad)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "ddp_register_grad: in the arena layout the library owns grad storage: pass NULL and ask "
         "ddp_grad_ptr where the grad lives");
  if (!cfg_.arena() && !grad)
    fail(DDP_ERR_INVALID_ARGUMENT, "ddp_register_grad: grad is NULL (the copy layout needs the user's buffer)");
  if (specs_.size() >= static_cast<size_t>(INT32_MAX)) fail(DDP_ERR_INVALID_ARGUMENT, "ddp_register_grad: too many grads");
  specs_.push_back(GradSpec{numel, dtype, flags});
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
  try {
    agree_registration(*ctrl_, specs_, deadline());
    ReducerEnv env;
    env.device = device_.get();
    env.comms = comms_;
    for (auto& s : streams_) env.streams.push_back(s.get());
    env.world = world_;
    env.arena = cfg_.arena();
    env.always_fp32 = (cfg_.c.allreduce_always_fp32 != 0);
    env.average = (cfg_.c.gradient_average != 0);
    env.predivide = cfg_.c.gradient_predivide_factor;
    env.check_finite = (cfg_.c.check_finite != 0);
    env.inplace_min_numel = cfg_.c.inplace_min_numel;
    env.timeout_ms = cfg_.c.timeout_ms;
    env.counters = &counters_;
    env.timeline = timeline_.get();
    reducer_.reset(new Reducer(env, specs_));
    reducer_->adopt(registration_plan(specs_, cfg_.c.message_size, cfg_.c.num_streams), user_ptrs_);
    learner_.reset(specs_.size());
    scratch_unused_.reserve(specs_.size());
    state_ = State::Idle;
  } catch (const Error& e) {
    abort(e);  // ranks disagree or a buffer could not be had: nothing sensible can follow
    throw;
  }
}

void* Context::grad_ptr(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  check_index(index, "ddp_grad_ptr");
  if (!cfg_.arena()) return user_ptrs_[static_cast<size_t>(index)];
  commit_locked();
  return reducer_->grad_ptr(index);
}

void Context::set_grad_ptr(int index, void* grad) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  check_index(index, "ddp_set_grad_ptr");
  if (cfg_.arena())
    fail(DDP_ERR_INVALID_STATE, "ddp_set_grad_ptr: in the arena layout the library owns grad storage");
  if (!grad) fail(DDP_ERR_INVALID_ARGUMENT, "ddp_set_grad_ptr: grad is NULL");
  if (state_ == State::InBackward && reducer_->is_ready(index))
    fail(DDP_ERR_INVALID_STATE, "ddp_set_grad_ptr: grad %d is already marked ready in this backward pass", index);
  user_ptrs_[static_cast<size_t>(index)] = grad;
  if (reducer_) reducer_->set_grad_ptr(index, grad);
}

// ---------------------------------------------------------------------------------------------
// The iteration
// ---------------------------------------------------------------------------------------------

void Context::begin_backward(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (state_ == State::InBackward)
    fail(DDP_ERR_INVALID_STATE, "ddp_begin_backward: a backward pass is already in progress (call ddp_finish_backward first)");
  fatal_on_error([&] { commit_locked(); });
  iteration_synced_ = sync_;
  learning_ = sync_ && cfg_.learned() && !reducer_->plan().learned;
  if (learning_) learner_.reset(specs_.size());
  reducer_->begin(stream, iterations_);
  user_stream_ = stream;
  begin_ns_ = now_ns();
  state_ = State::InBackward;
}

void Context::grad_ready(int index, void* grad) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (state_ != State::InBackward)
    fail(DDP_ERR_INVALID_STATE, "ddp_grad_ready(%d): no backward pass in progress (call ddp_begin_backward first)", index);
  check_index(index, "ddp_grad_ready");
  if (reducer_->is_ready(index))
    fail(DDP_ERR_INVALID_STATE, "ddp_grad_ready: grad %d was already marked ready in this backward pass", index);
  if (grad) {
    if (cfg_.arena())
      fail(DDP_ERR_INVALID_STATE, "ddp_grad_ready_ptr: in the arena layout the library owns grad storage");
    if (grad != user_ptrs_[static_cast<size_t>(index)]) {
      user_ptrs_[static_cast<size_t>(index)] = grad;
      reducer_->set_grad_ptr(index, grad);
    }
  }
  const uint64_t t = now_ns();
  if (timeline_) timeline_->grad_ready(index, t);
  if (learning_) learner_.record(index);
  const bool launch = iteration_synced_ && !learning_ && cfg_.c.delay_allreduce == 0;
  fatal_on_error([&] { reducer_->mark_ready(index, launch, t); });
}

void Context::learn_plan() {
  // apex sync_bucket_structure: rank 0's learned buckets become every rank's.
  Plan local = learner_.finish(specs_, cfg_.c.message_size, cfg_.c.num_streams);
  std::vector<int64_t> wire(1 + 2 * specs_.size(), 0);
  if (rank_ == 0) {
    std::vector<int64_t> s = local.serialize();
    std::copy(s.begin(), s.end(), wire.begin());
  }
  ctrl_->broadcast_host(wire.data(), wire.size() * sizeof(int64_t), 0, deadline());
  Plan adopted = Plan::deserialize(wire.data(), wire.size(), specs_, cfg_.c.num_streams);
  std::vector<int> unready;
  reducer_->unready_grads(&unready);
  reducer_->adopt(std::move(adopted), user_ptrs_);
  if (cfg_.arena()) ++layout_epoch_;
  reducer_->begin(user_stream_, iterations_);
  std::vector<char> skip(specs_.size(), 0);
  for (int g : unready) skip[static_cast<size_t>(g)] = 1;
  const uint64_t t = now_ns();
  for (size_t g = 0; g < specs_.size(); ++g)
    if (!skip[g]) reducer_->mark_ready(static_cast<int>(g), false, t);
}

void Context::wait_buckets(void* stream) {
  const uint64_t t0 = now_ns();
  reducer_->finish(stream, Deadline::never());
  last_exposed_ns_ = now_ns() - t0;
  exposed_ns_ += last_exposed_ns_;
}

void Context::finish_backward(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (state_ != State::InBackward)
    fail(DDP_ERR_INVALID_STATE, "ddp_finish_backward: no backward pass in progress (call ddp_begin_backward first)");
  state_ = State::Idle;
  if (!iteration_synced_) return;  // no_sync: grads only accumulated locally
  std::string unused_text;
  fatal_on_error([&] {
    if (learning_) {
      learning_ = false;
      learn_plan();
    }
    reducer_->unready_grads(&scratch_unused_);
    reducer_->launch_rest();  // unused grads travel as zeros, so that no rank waits forever
    wait_buckets(stream);
    // The report is one more exchange between the ranks: after the buckets, so that a rank that died
    // or stalled is reported by the bucket that waited for it (step and bucket named).
    if (!cfg_.unused_zero()) unused_text = unused_report_.exchange(*ctrl_, scratch_unused_, deadline());
  });
  ++iterations_;
  if (timeline_) {
    timeline_->iteration(iterations_ - 1, begin_ns_, now_ns());
    timeline_->flush();
  }
  if (!unused_text.empty())
    fail(DDP_ERR_INVALID_STATE,
         "ddp_finish_backward: grads never marked ready in this iteration (reduced as zeros): %s. Mark every "
         "grad ready each iteration, or set unused_policy = DDP_UNUSED_ZERO",
         unused_text.c_str());
}

void Context::set_sync(bool enabled) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (state_ == State::InBackward)
    fail(DDP_ERR_INVALID_STATE, "ddp_set_sync: not allowed inside a backward pass (set it before ddp_begin_backward)");
  sync_ = enabled;
}

void Context::reduce_all(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (state_ == State::InBackward)
    fail(DDP_ERR_INVALID_STATE, "ddp_reduce_all: not allowed inside a backward pass");
  fatal_on_error([&] {
    commit_locked();
    reducer_->begin(stream, iterations_);
    reducer_->launch_all();
    wait_buckets(stream);
  });
  ++iterations_;
}

void Context::broadcast(void* const* buffers, const size_t* counts, const ddp_dtype_t* dtypes, int n, int root,
                        void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  if (n < 0) fail(DDP_ERR_INVALID_ARGUMENT, "ddp_broadcast: n is %d", n);
  if (n > 0 && (!buffers || !counts || !dtypes))
    fail(DDP_ERR_INVALID_ARGUMENT, "ddp_broadcast: buffers, counts and dtypes must not be NULL");
  if (root < 0 || root >= world_)
    fail(DDP_ERR_INVALID_ARGUMENT, "ddp_broadcast: root %d out of range 0..%d", root, world_ - 1);
  for (int i = 0; i < n; ++i) {
    if (!dtype_valid(enum_value(dtypes[i])))
      fail(DDP_ERR_INVALID_ARGUMENT, "ddp_broadcast: dtypes[%d] is %d, not a ddp_dtype_t", i, enum_value(dtypes[i]));
    if (counts[i] > 0 && !buffers[i]) fail(DDP_ERR_INVALID_ARGUMENT, "ddp_broadcast: buffers[%d] is NULL", i);
    if (counts[i] > SIZE_MAX / 16) fail(DDP_ERR_INVALID_ARGUMENT, "ddp_broadcast: counts[%d] is too large", i);
  }
  fatal_on_error([&] {
    for (int i = 0; i < n; ++i)
      if (counts[i])
        bcast_->broadcast(buffers[i], counts[i] * dtype_size(static_cast<Dtype>(dtypes[i])), root, stream,
                          deadline());
  });
}

void Context::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  fatal_on_error([&] {
    for (auto& s : streams_) s->drain(Deadline::never());
  });
}

void Context::stats(ddp_stats_t* out) {
  std::lock_guard<std::mutex> lock(mu_);
  ddp_stats_t s;
  std::memset(&s, 0, sizeof s);
  s.size = sizeof s;
  s.iterations = iterations_;
  s.buckets_reduced = counters_.buckets_reduced.load();
  s.bytes_reduced = counters_.bytes_reduced.load();
  s.comm_time_ns = counters_.comm_time_ns.load();
  s.exposed_time_ns = exposed_ns_;
  s.last_exposed_ns = last_exposed_ns_;
  s.library_bytes = reducer_ ? reducer_->buffer_bytes() : 0;
  s.arena_bytes = reducer_ ? reducer_->arena_bytes() : 0;
  s.nonfinite_buckets = counters_.nonfinite_buckets.load();
  s.layout_epoch = layout_epoch_;
  s.world_size = world_;
  s.rank = rank_;
  copy_sized(out, &s, out->size, sizeof s);
}

void Context::plan_info(int* num_buckets, int* learned) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_) fatal_on_error([&] { commit_locked(); });
  if (!reducer_) check_alive();
  *num_buckets = static_cast<int>(reducer_->plan().buckets.size());
  if (learned) *learned = reducer_->plan().learned ? 1 : 0;
}

void Context::bucket_info(int bucket, ddp_bucket_info_t* info, int* grads, size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_) fatal_on_error([&] { commit_locked(); });
  if (!reducer_) check_alive();
  const Plan& p = reducer_->plan();
  if (bucket < 0 || static_cast<size_t>(bucket) >= p.buckets.size())
    fail(DDP_ERR_INVALID_ARGUMENT, "ddp_get_bucket: bucket %d out of range (%zu buckets)", bucket, p.buckets.size());
  if (capacity > 0 && !grads) fail(DDP_ERR_INVALID_ARGUMENT, "ddp_get_bucket: grads is NULL but capacity is %zu", capacity);
  const Bucket& b = p.buckets[static_cast<size_t>(bucket)];
  info->dtype = static_cast<ddp_dtype_t>(b.dtype);
  info->wire = static_cast<ddp_dtype_t>(reducer_->wire(bucket));
  info->numel = b.numel;
  info->num_grads = static_cast<int>(b.grads.size());
  info->stream = b.stream;
  for (size_t i = 0; i < capacity && i < b.grads.size(); ++i) grads[i] = b.grads[i];
}

}  // namespace ddp
