// The reducer: its plan's runtime (bucket buffers, the arena), readiness and the launches in plan
// order; what a launched bucket runs is in bucket_steps.cpp.
#include "core/reducer.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "core/bucket_runtime.hpp"

namespace ddp {

Reducer::Reducer(const ReducerEnv& env, const std::vector<GradSpec>& specs)
    : env_(env), specs_(specs), int8_(*env.device, env.program, env.timeout_ms) {
  divisor_ = env_.program.world;
  // Host streams run each task to completion on a worker; GPU streams run it at once on the
  // submitting thread, where it only enqueues (and so can be grouped).
  workers_ = !env_.streams.empty() && !env_.streams[0]->runs_inline();
  for (Comm* c : env_.comms) caps_.push_back(Capabilities::of(*c, env_.program.piece_bytes, !workers_));
  // The streams keep the timeout: a collective of a dead peer never returns on its own.
  for (Stream* s : env_.streams) s->set_task_timeout(env_.timeout_ms);
  if (env_.program.shard)
    shards_.reset(new ShardSet(ShardSet::Env{env_.device, env_.comms, env_.streams, env_.program.rank, env_.timeout_ms,
                                             workers_, [this](int b) { return where(b); }}));
}

// Averages divide by `divisor` ranks from the next launch on (uneven inputs): only the programs'
// scaling changes.
void Reducer::set_divisor(int divisor) {
  divisor_ = divisor;
  rescale_program(program_, env_.program, caps_, divisor_);
}

// The device decides whether a buffer can be freed: one written by a collective it had to abandon is
// kept by the backend that could not cancel it.
Reducer::~Reducer() {
  for (void* p : staging_) env_.device->release(p);
  shards_.reset();  // (its parameter arena first: the grad arena outlives every view of it)
  env_.device->release(arena_);
}

std::string Reducer::where(int b) const {
  return format("iteration %llu, bucket %d of %zu (stream %d): ", static_cast<unsigned long long>(iteration_), b,
                rt_.size(), plan_.buckets[static_cast<size_t>(b)].stream);
}

void Reducer::adopt(Plan plan, const std::vector<void*>& user_ptrs) {
  Program program = compile_program(plan, specs_, env_.program, caps_, divisor_);
  std::vector<void*> ptrs = user_ptrs, old(specs_.size(), nullptr);
  std::vector<size_t> base(plan.buckets.size());
  size_t total = 0;
  char* old_arena = arena_;
  if (env_.program.arena) {
    // Storage follows the plan: each bucket one contiguous, 256-byte aligned range of one arena.
    for (size_t g = 0; arena_ && g < specs_.size(); ++g) old[g] = grad_ptr(static_cast<int>(g));
    for (size_t b = 0; b < plan.buckets.size(); ++b) {
      total = (total + 255) / 256 * 256;
      base[b] = total;
      total += program.buckets[b].padded * dtype_size(plan.buckets[b].dtype);
    }
    char* fresh = static_cast<char*>(env_.device->alloc(total));
    for (size_t b = 0; b < plan.buckets.size(); ++b) {
      const Bucket& bk = plan.buckets[b];
      for (size_t s = 0; s < bk.grads.size(); ++s) {
        const size_t g = static_cast<size_t>(bk.grads[s]);
        ptrs[g] = fresh + base[b] + bk.offsets[s] * dtype_size(bk.dtype);
        if (old[g]) env_.device->copy(ptrs[g], old[g], specs_[g].numel * dtype_size(bk.dtype));
      }
    }
    arena_ = fresh;
    arena_bytes_ = total;
  }
  plan_ = std::move(plan);
  program_ = std::move(program);
  if (shards_)
    shards_->relayout(program_, arena_, base, total, [&](char* fresh) {
      for (size_t g = 0; g < specs_.size(); ++g)
        if (old[g])
          env_.device->copy(fresh + (static_cast<char*>(ptrs[g]) - arena_), shards_->param_of(old[g]),
                            specs_[g].numel * dtype_size(specs_[g].dtype));
    });
  build_runtime(ptrs);
  if (old_arena != arena_) env_.device->release(old_arena);
}

// Bucket b's runtime: its tasks, and which grads its program packs or reduces in place.
std::unique_ptr<Reducer::BucketRt> Reducer::make_bucket(size_t b, const std::vector<void*>& ptrs) const {
  const Bucket& bk = plan_.buckets[b];
  const BucketProgram& p = program_.buckets[b];
  std::unique_ptr<BucketRt> r(new BucketRt());
  Reducer* self = const_cast<Reducer*>(this);
  const Step steps[] = {Step::Whole, Step::In, Step::Collectives, Step::Out};
  StepTask* tasks[] = {&r->whole, &r->in, &r->collectives, &r->out};
  for (int k = 0; k < 4; ++k) {
    tasks[k]->reducer = self;
    tasks[k]->bucket = static_cast<int>(b);
    tasks[k]->step = steps[k];
  }
  r->size = static_cast<int>(bk.grads.size());
  size_t packed = 0;
  for (size_t s = 0; s < bk.grads.size(); ++s) {
    size_t g = static_cast<size_t>(bk.grads[s]);
    const size_t n = specs_[g].numel;
    if (p.direct[s]) {
      r->direct.segs.push_back(Segment{ptrs[g], 0, n, 0});
      r->where.emplace_back(&r->direct, r->direct.segs.size() - 1);
    } else {
      r->packed.segs.push_back(Segment{ptrs[g], packed, n, 0});
      r->where.emplace_back(&r->packed, r->packed.segs.size() - 1);
      packed += n;
    }
  }
  if (env_.program.arena) r->base = static_cast<char*>(ptrs[static_cast<size_t>(bk.grads[0])]);
  return r;
}

void Reducer::build_runtime(const std::vector<void*>& ptrs) {
  const size_t nb = plan_.buckets.size();
  const int ns = static_cast<int>(env_.streams.size());
  std::vector<size_t> staging_need(static_cast<size_t>(ns), 0);
  rt_.clear();
  for (size_t b = 0; b < nb; ++b) {
    const BucketProgram& p = program_.buckets[b];
    std::unique_ptr<BucketRt> r = make_bucket(b, ptrs);
    size_t& need = staging_need[static_cast<size_t>(p.stream)];
    const size_t bytes = int8_.stage_bytes(p);
    if (program_.group) {
      // A grouped launch packs every bucket before any collective: each needs its own range.
      r->stage_offset = need;
      need += (bytes + 255) / 256 * 256;
    } else {
      need = std::max(need, bytes);
    }
    rt_.push_back(std::move(r));
  }
  // One staging buffer per stream. Host streams run their buckets one after another, so they share
  // it (as large as the largest bucket); GPU streams may group buckets, so each has its own range.
  for (void* p : staging_) env_.device->release(p);
  staging_.assign(static_cast<size_t>(ns), nullptr);
  staging_bytes_ = 0;
  for (int s = 0; s < ns; ++s) {
    size_t need = staging_need[static_cast<size_t>(s)];
    if (need) staging_[static_cast<size_t>(s)] = env_.device->alloc(need);
    staging_bytes_ += need;
  }
  reserve_tasks();
  int8_.adopt(program_, static_cast<size_t>(ns));
  if (env_.check_finite) env_.device->reserve_flags(nb);
  ready_.assign(specs_.size(), 0);
  zero_.assign(specs_.size(), 0);
  next_ = 0;
}

// Room on each stream for every task it may hold at once, so that submit never finds its ring full:
// per bucket of the stream, its steps (a grouped launch submits three, in, collectives and out;
// otherwise one) and, in a sharded context, its parameter gather, which may still be queued when the
// bucket's next reduction is submitted.
void Reducer::reserve_tasks() {
  std::vector<size_t> tasks(env_.streams.size(), 0);
  const size_t per_bucket = (program_.group ? 3 : 1) + (shards_ ? 1 : 0);
  for (const BucketProgram& p : program_.buckets) tasks[static_cast<size_t>(p.stream)] += per_bucket;
  for (size_t s = 0; s < tasks.size(); ++s) env_.streams[s]->reserve(tasks[s] + 1);
}

uint64_t Reducer::latest_start_ns() const {
  uint64_t t = 0;
  for (const auto& r : rt_) t = std::max(t, r->start_ns);
  return t;
}

// What this rank owes for its own contribution only: a scatter bucket's shard errors belong to the
// sum of every rank's contributions, which this rank still re-quantizes.
void Reducer::clear_feedback() {
  int8_.clear(program_, [this](int b) -> Stream& { return stream_of(b); });
}

void* Reducer::staging(int b) const {
  const BucketRt& r = *rt_[static_cast<size_t>(b)];
  return static_cast<char*>(staging_[static_cast<size_t>(plan_.buckets[static_cast<size_t>(b)].stream)]) +
         r.stage_offset;
}

void* Reducer::grad_ptr(int g) const {
  const BucketRt& r = *rt_[static_cast<size_t>(plan_.bucket_of[static_cast<size_t>(g)])];
  auto& w = r.where[static_cast<size_t>(plan_.slot_of[static_cast<size_t>(g)])];
  return w.first->segs[w.second].ptr;
}

void Reducer::set_grad_ptr(int g, void* p) {
  BucketRt& r = *rt_[static_cast<size_t>(plan_.bucket_of[static_cast<size_t>(g)])];
  auto& w = r.where[static_cast<size_t>(plan_.slot_of[static_cast<size_t>(g)])];
  Segment& seg = w.first->segs[w.second];
  if (seg.ptr != p) {
    seg.ptr = p;
    ++w.first->version;
  }
}

void Reducer::set_zero(int g, bool zero) {
  BucketRt& r = *rt_[static_cast<size_t>(plan_.bucket_of[static_cast<size_t>(g)])];
  auto& w = r.where[static_cast<size_t>(plan_.slot_of[static_cast<size_t>(g)])];
  w.first->segs[w.second].zero = zero ? 1u : 0u;
  ++w.first->version;
  zero_[static_cast<size_t>(g)] = zero ? 1 : 0;
}

void Reducer::begin(void* user_stream, uint64_t iteration) {
  env_.device->check_user_stream(user_stream);  // before anything changes: a refusal leaves no trace
  std::fill(ready_.begin(), ready_.end(), 0);
  for (auto& r : rt_) r->ready = 0;
  next_ = 0;
  env_.progress->launched.store(0, std::memory_order_relaxed);
  env_.progress->done.store(0, std::memory_order_relaxed);
  env_.progress->buckets.store(static_cast<int32_t>(rt_.size()), std::memory_order_relaxed);
  user_stream_ = user_stream;
  iteration_ = iteration;
}

bool Reducer::mark_ready(int g, bool launch, uint64_t t_ns) {
  char& flag = ready_[static_cast<size_t>(g)];
  if (flag) return false;
  flag = 1;
  if (zero_[static_cast<size_t>(g)]) set_zero(g, false);
  BucketRt& r = *rt_[static_cast<size_t>(plan_.bucket_of[static_cast<size_t>(g)])];
  if (++r.ready == r.size) {
    r.ready_ns = t_ns;
    if (launch) launch_ready_in_order();
  }
  return true;
}

void Reducer::unready_grads(std::vector<int>* out) const {
  out->clear();
  for (size_t g = 0; g < ready_.size(); ++g)
    if (!ready_[g]) out->push_back(static_cast<int>(g));
}

void Reducer::launch_rest() {
  const uint64_t t = now_ns();
  for (size_t g = 0; g < ready_.size(); ++g) {
    if (ready_[g]) continue;
    ready_[g] = 1;
    if (!zero_[g]) set_zero(static_cast<int>(g), true);
    BucketRt& r = *rt_[static_cast<size_t>(plan_.bucket_of[g])];
    if (++r.ready == r.size) r.ready_ns = t;
  }
  launch_ready_in_order();
}

void Reducer::launch_all() {
  const uint64_t t = now_ns();
  for (size_t g = 0; g < ready_.size(); ++g)
    if (!ready_[g]) mark_ready(static_cast<int>(g), false, t);
  launch_ready_in_order();
}

// apex's next_bucket rule: bucket i launches only after every bucket before it, so that every rank
// issues the same collectives in the same order whatever order its grads arrive in.
void Reducer::launch_ready_in_order() {
  const int nb = static_cast<int>(rt_.size());
  const int first = next_;
  while (next_ < nb && rt_[static_cast<size_t>(next_)]->ready == rt_[static_cast<size_t>(next_)]->size) ++next_;
  // Buckets that become ready together go to NCCL as one group (ncclGroupStart/End): one launch of
  // all their collectives. Host streams run each bucket whole on its worker instead.
  env_.progress->launched.store(next_, std::memory_order_relaxed);
  if (next_ - first >= 2 && program_.group) {
    launch_grouped(first, next_);
    return;
  }
  for (int b = first; b < next_; ++b) launch(b);
}

Reducer::Work Reducer::work(int b) {
  const BucketProgram& p = program_.buckets[static_cast<size_t>(b)];
  return Work{p, *rt_[static_cast<size_t>(b)], stream_of(b), *env_.device, *env_.comms[static_cast<size_t>(p.stream)]};
}

Stream& Reducer::stream_of(int b) {
  return *env_.streams[static_cast<size_t>(plan_.buckets[static_cast<size_t>(b)].stream)];
}

void* Reducer::buffer(int b) const {
  return program_.buckets[static_cast<size_t>(b)].staged ? staging(b) : rt_[static_cast<size_t>(b)]->base;
}

void Reducer::launch(int b) {
  BucketRt& r = *rt_[static_cast<size_t>(b)];
  Stream& s = stream_of(b);
  r.launch_ns = now_ns();
  r.done = false;
  env_.device->stream_wait_user(s, user_stream_);
  s.submit(&r.whole);
  r.mark = s.submitted();
}

// GPU streams run a task at once on this thread, where it only enqueues: so the steps of several
// buckets are interleaved: every in step, then every collective inside one group, then every out step.
// (Inside a group NCCL defers the collectives to the group's end, so an unpack enqueued before the end
// would run before its collective.)
void Reducer::launch_grouped(int first, int last) {
  for (int b = first; b < last; ++b) {
    BucketRt& r = *rt_[static_cast<size_t>(b)];
    r.launch_ns = now_ns();
    r.done = false;
    env_.device->stream_wait_user(stream_of(b), user_stream_);
    stream_of(b).submit(&r.in);
  }
  Comm& c = *env_.comms[static_cast<size_t>(plan_.buckets[static_cast<size_t>(first)].stream)];
  c.group_start();
  try {
    for (int b = first; b < last; ++b) stream_of(b).submit(&rt_[static_cast<size_t>(b)]->collectives);
  } catch (...) {
    try {
      c.group_end();
    } catch (...) {
    }
    throw;
  }
  c.group_end();
  for (int b = first; b < last; ++b) {
    stream_of(b).submit(&rt_[static_cast<size_t>(b)]->out);
    rt_[static_cast<size_t>(b)]->mark = stream_of(b).submitted();
  }
}

// Host streams: the host waits (each stream keeps the timeout of its blocked collectives). GPU
// streams: the user's stream waits. Then the finiteness flags, where the host waited anyway.
void Reducer::finish(void* user_stream, Deadline dl) {
  std::exception_ptr first;
  for (size_t i = 0; i < env_.streams.size(); ++i) {
    Stream& s = *env_.streams[i];
    try {
      if (!workers_) {
        env_.device->user_wait_stream(user_stream, s);
        s.poll_error();
      } else {
        s.drain(dl);
      }
    } catch (const Error& e) {
      // A task's own error names its bucket already; the stream's timeout does not.
      const bool named = std::strncmp(e.what(), "iteration ", 10) == 0;
      if (!first)
        first = std::make_exception_ptr(
            e.status() == DDP_ERR_TIMEOUT && !named ? Error(e.status(), stuck(static_cast<int>(i)) + e.what()) : e);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
  if (next_ != static_cast<int>(rt_.size()))
    fail(DDP_ERR_INTERNAL, "epilogue: %d of %zu buckets were launched", next_, rt_.size());
  if (!env_.check_finite) return;
  for (int b = 0; b < next_; ++b)
    if (env_.device->take_nonfinite(static_cast<size_t>(b), stream_of(b)))
      env_.stats->nonfinite_buckets.fetch_add(1, std::memory_order_relaxed);
}

void Reducer::wait_grad(int g, void* user_stream, Deadline dl) {
  const int b = plan_.bucket_of[static_cast<size_t>(g)];
  const int si = plan_.buckets[static_cast<size_t>(b)].stream;
  Stream& s = stream_of(b);
  try {
    if (!workers_) {
      s.user_wait_tag(user_stream, b);
      s.poll_error();
    } else {
      s.drain_to(rt_[static_cast<size_t>(b)]->mark, dl);
    }
  } catch (const Error& e) {
    const bool named = std::strncmp(e.what(), "iteration ", 10) == 0;  // as in finish
    if (e.status() == DDP_ERR_TIMEOUT && !named) throw Error(e.status(), stuck(si) + e.what());
    throw;
  }
}

// Where stream `si` stands: its first launched bucket that has not finished (a task that timed out
// in the stream's drain names no bucket itself). GPU streams know; their buckets' `done` flags are
// never set (the stream counts them when they complete), so only host streams read those.
std::string Reducer::stuck(int si) const {
  const int gpu = env_.streams[static_cast<size_t>(si)]->oldest_unfinished();
  if (gpu >= 0 && gpu < next_) return where(gpu);
  for (int b = 0; workers_ && b < next_; ++b)
    if (plan_.buckets[static_cast<size_t>(b)].stream == si && !rt_[static_cast<size_t>(b)]->done) return where(b);
  return format("iteration %llu, stream %d: ", static_cast<unsigned long long>(iteration_), si);
}

// The grad side of a sharded bucket is the reduce-scatter step; the rest is the shard set's.
ShardSet& Reducer::shards() {
  if (!shards_) fail(DDP_ERR_INTERNAL, "not a sharded context");
  return *shards_;
}

void Reducer::cancel() {
  for (Stream* s : env_.streams) s->cancel();
}

}  // namespace ddp
