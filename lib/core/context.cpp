#include "core/context.hpp"

#include <algorithm>
#include "core/handles.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace ddp {

// ---------------------------------------------------------------------------------------------
// Config
// ---------------------------------------------------------------------------------------------

// The size of the first version of ddp_config_t: every caller's struct is at least this big.
static constexpr size_t kConfigV1Size = sizeof(ddp_config_t);

Settings read_config(const ddp_config_t* config, int comm_size, Memory memory) {
  ddp_config_t c;
  ddp_config_init(&c);
  if (config) {
    if (config->size < kConfigV1Size)
      fail(DDP_ERR_INVALID_ARGUMENT,
           "config->size is %zu, smaller than any known ddp_config_t (%zu): initialize the config with "
           "DDP_CONFIG_INITIALIZER or ddp_config_init",
           config->size, kConfigV1Size);
    if (config->magic != DDP_CONFIG_MAGIC)
      fail(DDP_ERR_INVALID_ARGUMENT,
           "config->magic is 0x%08x, not DDP_CONFIG_MAGIC (0x%08x): initialize the config with "
           "DDP_CONFIG_INITIALIZER or ddp_config_init",
           config->magic, DDP_CONFIG_MAGIC);
    if (config->version == 0)
      fail(DDP_ERR_INVALID_ARGUMENT, "config->version is 0: initialize the config with ddp_config_init");
    std::memcpy(&c, config, std::min(config->size, sizeof c));
  }
  Settings s;
  if (c.message_size == 0) fail(DDP_ERR_INVALID_ARGUMENT, "config.message_size must be at least 1 element");
  s.message_size = c.message_size;
  s.delay_allreduce = c.delay_allreduce != 0;
  if (c.layout != DDP_LAYOUT_COPY && c.layout != DDP_LAYOUT_ARENA)
    fail(DDP_ERR_INVALID_ARGUMENT, "config.layout is %d: use DDP_LAYOUT_COPY (0) or DDP_LAYOUT_ARENA (1)", c.layout);
  s.arena = c.layout == DDP_LAYOUT_ARENA;
  if (c.plan_order != DDP_PLAN_LEARNED && c.plan_order != DDP_PLAN_REGISTRATION)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "config.plan_order is %d: use DDP_PLAN_LEARNED (0) or DDP_PLAN_REGISTRATION (1)", c.plan_order);
  s.learned = c.plan_order == DDP_PLAN_LEARNED;
  s.always_fp32 = c.allreduce_always_fp32 != 0;
  s.average = c.gradient_average != 0;
  if (!(c.gradient_predivide_factor > 0.0) || !std::isfinite(c.gradient_predivide_factor))
    fail(DDP_ERR_INVALID_ARGUMENT, "config.gradient_predivide_factor is %g: it must be finite and > 0",
         c.gradient_predivide_factor);
  s.predivide = c.gradient_predivide_factor;
  if (c.num_streams < 1 || c.num_streams > 64)
    fail(DDP_ERR_INVALID_ARGUMENT, "config.num_streams is %d: it must be in 1..64", c.num_streams);
  s.num_streams = c.num_streams;
  if (c.stream_comms) {
    for (int i = 0; i < c.num_streams; ++i) {
      ddp_comm_t h = c.stream_comms[i];
      if (!h) fail(DDP_ERR_INVALID_ARGUMENT, "config.stream_comms[%d] is NULL", i);
      Comm* sc = comm_of(h);
      if (sc->size() != comm_size || sc->memory() != memory)
        fail(DDP_ERR_INVALID_ARGUMENT,
             "config.stream_comms[%d] spans %d ranks of %s memory; the context's comm spans %d ranks of %s memory",
             i, sc->size(), sc->memory() == Memory::Host ? "host" : "device", comm_size,
             memory == Memory::Host ? "host" : "device");
      s.stream_comms.push_back(sc);
    }
  }
  if (c.timeout_ms < 0) fail(DDP_ERR_INVALID_ARGUMENT, "config.timeout_ms is %lld: use 0 to wait forever", static_cast<long long>(c.timeout_ms));
  s.timeout_ms = c.timeout_ms;
  if (c.unused_policy != DDP_UNUSED_ERROR && c.unused_policy != DDP_UNUSED_ZERO)
    fail(DDP_ERR_INVALID_ARGUMENT, "config.unused_policy is %d: use DDP_UNUSED_ERROR (0) or DDP_UNUSED_ZERO (1)",
         c.unused_policy);
  s.unused_zero = c.unused_policy == DDP_UNUSED_ZERO;
  if (c.timeline_path && c.timeline_path[0]) {
    s.timeline_path = c.timeline_path;
  } else if (const char* env = std::getenv("DDP_TIMELINE")) {
    s.timeline_path = env;
  }
  s.check_finite = c.check_finite != 0;
  s.inplace_min_numel = c.inplace_min_numel;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Life cycle
// ---------------------------------------------------------------------------------------------

Context::Context(Comm& comm, const Settings& settings) : cfg_(settings) {
  rank_ = comm.rank();
  world_ = comm.size();
  ctrl_ = comm.dup();
  // Settings that decide how many collectives follow (num_streams) are agreed on before any of them.
  check_agreement(false);
  bcast_ = comm.dup();
  if (cfg_.stream_comms.empty()) {
    for (int i = 0; i < cfg_.num_streams; ++i) {
      owned_comms_.push_back(comm.dup());
      comms_.push_back(owned_comms_.back().get());
    }
  } else {
    comms_ = cfg_.stream_comms;
  }
  device_ = comm.make_device();
  for (int i = 0; i < cfg_.num_streams; ++i) streams_.push_back(device_->make_stream(i));
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
  if (cfg_.arena && grad)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "ddp_register_grad: in the arena layout the library owns grad storage: pass NULL and ask "
         "ddp_grad_ptr where the grad lives");
  if (!cfg_.arena && !grad)
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
    check_agreement(true);
    ReducerEnv env;
    env.device = device_.get();
    env.comms = comms_;
    for (auto& s : streams_) env.streams.push_back(s.get());
    env.world = world_;
    env.arena = cfg_.arena;
    env.always_fp32 = cfg_.always_fp32;
    env.average = cfg_.average;
    env.predivide = cfg_.predivide;
    env.check_finite = cfg_.check_finite;
    env.inplace_min_numel = cfg_.inplace_min_numel;
    env.timeout_ms = cfg_.timeout_ms;
    env.counters = &counters_;
    env.timeline = timeline_.get();
    reducer_.reset(new Reducer(env, specs_));
    reducer_->adopt(registration_plan(specs_, cfg_.message_size, cfg_.num_streams), user_ptrs_);
    learner_.reset(specs_.size());
    scratch_unused_.reserve(specs_.size());
    state_ = State::Idle;
  } catch (const Error& e) {
    abort(e);  // ranks disagree or a buffer could not be had: nothing sensible can follow
    throw;
  }
}

// Every rank must register the same grads under the same settings. One fixed-size allgather of a
// summary answers that; only when it shows a difference do further rounds find the first one.
namespace {
struct Summary {
  uint64_t reg_hash;
  int64_t num_grads;
  int64_t message_size;
  int64_t inplace_min_numel;
  double predivide;
  int32_t layout, plan_order, delay, always_fp32, average, num_streams, unused_zero, memory;
};
struct RegEntry {
  uint64_t numel;
  uint32_t dtype, flags;
};
struct FirstDiff {
  int64_t index;  // first differing grad, or -1
  uint64_t numel;
  uint32_t dtype, flags;
  int64_t count;
};
}  // namespace

void Context::check_agreement(bool registration) {
  Summary me;
  std::memset(&me, 0, sizeof me);
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  for (const GradSpec& s : specs_) {
    mix(s.numel);
    mix(static_cast<uint64_t>(s.dtype) | (static_cast<uint64_t>(s.flags) << 8));
  }
  me.reg_hash = h;
  me.num_grads = static_cast<int64_t>(specs_.size());
  me.message_size = static_cast<int64_t>(cfg_.message_size);
  me.inplace_min_numel = static_cast<int64_t>(cfg_.inplace_min_numel);
  me.predivide = cfg_.predivide;
  me.layout = cfg_.arena;
  me.plan_order = cfg_.learned;
  me.delay = cfg_.delay_allreduce;
  me.always_fp32 = cfg_.always_fp32;
  me.average = cfg_.average;
  me.num_streams = cfg_.num_streams;
  me.unused_zero = cfg_.unused_zero;
  me.memory = ctrl_->memory() == Memory::Host ? 0 : 1;

  const Deadline dl = Deadline::after_ms(cfg_.timeout_ms);
  std::vector<Summary> all(static_cast<size_t>(world_));
  ctrl_->allgather_host(&me, all.data(), sizeof me, dl);

  // Config fields, in a fixed order: the first that differs from rank 0 on any rank is named.
  struct Field {
    const char* name;
    double (*get)(const Summary&);
  };
  static const Field fields[] = {
      {"layout", [](const Summary& s) { return double(s.layout); }},
      {"plan_order (1 = learned)", [](const Summary& s) { return double(s.plan_order); }},
      {"message_size", [](const Summary& s) { return double(s.message_size); }},
      {"delay_allreduce", [](const Summary& s) { return double(s.delay); }},
      {"allreduce_always_fp32", [](const Summary& s) { return double(s.always_fp32); }},
      {"gradient_average", [](const Summary& s) { return double(s.average); }},
      {"gradient_predivide_factor", [](const Summary& s) { return s.predivide; }},
      {"num_streams", [](const Summary& s) { return double(s.num_streams); }},
      {"unused_policy", [](const Summary& s) { return double(s.unused_zero); }},
      {"inplace_min_numel", [](const Summary& s) { return double(s.inplace_min_numel); }},
      {"memory kind (1 = device)", [](const Summary& s) { return double(s.memory); }},
  };
  if (!registration) {
    for (const Field& f : fields) {
    for (int r = 1; r < world_; ++r) {
      double a = f.get(all[0]), b = f.get(all[static_cast<size_t>(r)]);
      if (a != b)
        fail(DDP_ERR_MISMATCH, "ranks disagree on the config: %s is %.17g on rank 0 but %.17g on rank %d", f.name, a,
             b, r);
      }
    }
    return;
  }
  bool same = true;
  for (int r = 1; r < world_; ++r)
    same = same && all[static_cast<size_t>(r)].reg_hash == all[0].reg_hash &&
           all[static_cast<size_t>(r)].num_grads == all[0].num_grads;
  if (same) return;

  // Registration differs: every rank compares itself with rank 0's list, then all learn the first
  // difference of every rank.
  const size_t n0 = static_cast<size_t>(all[0].num_grads);
  std::vector<RegEntry> ref(n0);
  if (rank_ == 0)
    for (size_t i = 0; i < n0; ++i)
      ref[i] = RegEntry{specs_[i].numel, static_cast<uint32_t>(specs_[i].dtype), specs_[i].flags};
  if (n0) ctrl_->broadcast_host(ref.data(), n0 * sizeof(RegEntry), 0, dl);
  FirstDiff mine{-1, 0, 0, 0, static_cast<int64_t>(specs_.size())};
  const size_t common = std::min(n0, specs_.size());
  for (size_t i = 0; i < common && mine.index < 0; ++i) {
    const GradSpec& s = specs_[i];
    if (s.numel != ref[i].numel || static_cast<uint32_t>(s.dtype) != ref[i].dtype || s.flags != ref[i].flags)
      mine = FirstDiff{static_cast<int64_t>(i), s.numel, static_cast<uint32_t>(s.dtype), s.flags, mine.count};
  }
  if (mine.index < 0 && specs_.size() != n0) mine.index = static_cast<int64_t>(common);
  std::vector<FirstDiff> diffs(static_cast<size_t>(world_));
  ctrl_->allgather_host(&mine, diffs.data(), sizeof mine, dl);
  int worst = -1;
  for (int r = 1; r < world_; ++r) {
    const FirstDiff& d = diffs[static_cast<size_t>(r)];
    if (d.index >= 0 && (worst < 0 || d.index < diffs[static_cast<size_t>(worst)].index)) worst = r;
  }
  if (worst < 0) fail(DDP_ERR_MISMATCH, "ranks registered different grads (their signatures differ)");
  const FirstDiff& d = diffs[static_cast<size_t>(worst)];
  const size_t i = static_cast<size_t>(d.index);
  if (i >= n0 || i >= static_cast<size_t>(d.count))
    fail(DDP_ERR_MISMATCH,
         "ranks registered different grads: rank %d registered %lld grads but rank 0 registered %zu (the first "
         "%zu agree)",
         worst, static_cast<long long>(d.count), n0, std::min(n0, static_cast<size_t>(d.count)));
  fail(DDP_ERR_MISMATCH,
       "ranks registered different grads: grad %zu is %s[%llu] (flags 0x%x) on rank 0 but %s[%llu] (flags 0x%x) "
       "on rank %d",
       i, dtype_name(static_cast<Dtype>(ref[i].dtype)), static_cast<unsigned long long>(ref[i].numel), ref[i].flags,
       dtype_name(static_cast<Dtype>(d.dtype)), static_cast<unsigned long long>(d.numel), d.flags, worst);
}

void* Context::grad_ptr(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  check_index(index, "ddp_grad_ptr");
  if (!cfg_.arena) return user_ptrs_[static_cast<size_t>(index)];
  commit_locked();
  return reducer_->grad_ptr(index);
}

void Context::set_grad_ptr(int index, void* grad) {
  std::lock_guard<std::mutex> lock(mu_);
  check_alive();
  check_index(index, "ddp_set_grad_ptr");
  if (cfg_.arena)
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
  learning_ = sync_ && cfg_.learned && !reducer_->plan().learned;
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
    if (cfg_.arena)
      fail(DDP_ERR_INVALID_STATE, "ddp_grad_ready_ptr: in the arena layout the library owns grad storage");
    if (grad != user_ptrs_[static_cast<size_t>(index)]) {
      user_ptrs_[static_cast<size_t>(index)] = grad;
      reducer_->set_grad_ptr(index, grad);
    }
  }
  const uint64_t t = now_ns();
  if (timeline_) timeline_->grad_ready(index, t);
  if (learning_) learner_.record(index);
  const bool launch = iteration_synced_ && !learning_ && !cfg_.delay_allreduce;
  fatal_on_error([&] { reducer_->mark_ready(index, launch, t); });
}

void Context::learn_plan() {
  // apex sync_bucket_structure: rank 0's learned buckets become every rank's.
  Plan local = learner_.finish(specs_, cfg_.message_size, cfg_.num_streams);
  std::vector<int64_t> wire(1 + 2 * specs_.size(), 0);
  if (rank_ == 0) {
    std::vector<int64_t> s = local.serialize();
    std::copy(s.begin(), s.end(), wire.begin());
  }
  ctrl_->broadcast_host(wire.data(), wire.size() * sizeof(int64_t), 0, Deadline::after_ms(cfg_.timeout_ms));
  Plan adopted = Plan::deserialize(wire.data(), wire.size(), specs_, cfg_.num_streams);
  std::vector<int> unready;
  reducer_->unready_grads(&unready);
  reducer_->adopt(std::move(adopted), user_ptrs_);
  if (cfg_.arena) ++layout_epoch_;
  reducer_->begin(user_stream_, iterations_);
  std::vector<char> skip(specs_.size(), 0);
  for (int g : unready) skip[static_cast<size_t>(g)] = 1;
  const uint64_t t = now_ns();
  for (size_t g = 0; g < specs_.size(); ++g)
    if (!skip[g]) reducer_->mark_ready(static_cast<int>(g), false, t);
}

// Error policy: every rank must report the same grads, so the ranks exchange what they lack.
std::string Context::unused_report(const std::vector<int>& unused) {
  UnusedInfo me{static_cast<int32_t>(unused.size()), {-1, -1, -1, -1, -1, -1}};
  for (size_t i = 0; i < unused.size() && i < 6; ++i) me.first[i] = unused[i];
  std::vector<UnusedInfo>& all = unused_all_;  // kept: nothing allocates per iteration
  all.resize(static_cast<size_t>(world_));
  ctrl_->allgather_host(&me, all.data(), sizeof me, Deadline::after_ms(cfg_.timeout_ms));
  std::string text;
  for (int r = 0; r < world_; ++r) {
    const UnusedInfo& in = all[static_cast<size_t>(r)];
    if (in.count == 0) continue;
    text += text.empty() ? "" : "; ";
    text += format("rank %d: grad", r);
    if (in.count > 1) text += "s";
    for (int i = 0; i < in.count && i < 6; ++i) text += format("%s %d", i ? "," : "", in.first[i]);
    if (in.count > 6) text += format(" and %d more", in.count - 6);
  }
  return text;
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
    if (!cfg_.unused_zero) unused_text = unused_report(scratch_unused_);
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
                          Deadline::after_ms(cfg_.timeout_ms));
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
  std::memcpy(reinterpret_cast<char*>(out) + sizeof(size_t), reinterpret_cast<char*>(&s) + sizeof(size_t),
              std::min(out->size, sizeof s) - sizeof(size_t));
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
