#include "core/reducer.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "kernels/elementwise.h"

namespace ddp {

namespace {
// A bucket's allreduce: f32 elements whose bytes travel in 16 bits cast inside the host ring
// (BucketProgram::ring_cast), anything else as the comm's plain allreduce.
void allreduce(const BucketProgram& p, Comm& c, Stream& s, const void* from, void* to, size_t n, Dtype d, Deadline dl) {
  if (p.ring_cast)
    c.allreduce_as(from, to, n, d, p.send, p.red, s, dl);
  else
    c.allreduce(from, to, n, d, p.red, s, dl);
}
}  // namespace

// One step of a bucket's program, as a task of its own: the whole bucket (a host worker, or a GPU
// bucket launched alone), or one of the steps a grouped GPU launch interleaves across buckets.
struct Reducer::StepTask final : Task {
  Reducer* reducer = nullptr;
  int bucket = 0;
  Step step = Step::Whole;
  void run() override { reducer->run_step(bucket, step); }
};

// A bucket's runtime: what changes while the program runs (pointers, readiness, progress).
struct Reducer::BucketRt {
  StepTask whole, in, collectives, out;
  SegmentTable packed;                                  // staged: grads packed into staging; arena: each grad's view
  SegmentTable direct;                                  // copy layout: grads reduced in place, each its own collective
  std::vector<std::pair<SegmentTable*, size_t>> where;  // per slot: its table entry
  size_t stage_offset = 0;                              // bytes into its stream's staging buffer
  size_t residual_at = 0;                               // int8: its first kept rounding error in residual_
  size_t shard_residual_at = 0;                         // int8 scatter: those of re-quantizing this rank's shard
  std::atomic<bool> done{false};  // this iteration's work finished (names the bucket a timeout hit)
  int size = 0;
  int ready = 0;
  char* base = nullptr;  // arena: the bucket's storage
  uint64_t ready_ns = 0, launch_ns = 0, start_ns = 0;
  uint64_t mark = 0;  // host streams: its stream's task count once its task was submitted (drain_to)
};

// A bucket's failure says which step and bucket it was: the first thing to know when a rank died
// or stalled.
void Reducer::run_step(int b, Step step) {
  try {
    switch (step) {
      case Step::Whole:
        if (program_.buckets[static_cast<size_t>(b)].piece) {
          pieces(b);
          return;
        }
        step_in(b);
        step_collectives(b, true);
        step_out(b);
        return;
      case Step::In: return step_in(b);
      case Step::Collectives: return step_collectives(b, false);
      case Step::Out: return step_out(b);
    }
  } catch (const Error& e) {
    const ddp_status_t st = e.status();
    if (env_.on_failure && (st == DDP_ERR_TIMEOUT || st == DDP_ERR_ABORTED || st == DDP_ERR_NCCL)) env_.on_failure();
    throw Error(e.status(), where(b) + e.what());
  }
}

Reducer::Reducer(const ReducerEnv& env, const std::vector<GradSpec>& specs) : env_(env), specs_(specs) {
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
  for (void* p : gather_) env_.device->release(p);
  env_.device->release(residual_);
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
  residuals_ = 0;
  for (size_t b = 0; b < nb; ++b) {
    const BucketProgram& p = program_.buckets[b];
    std::unique_ptr<BucketRt> r = make_bucket(b, ptrs);
    if (p.collective == Collective::Int8) {
      r->residual_at = residuals_;
      residuals_ += p.numel;
      if (p.int8_scatter) {
        const Span mine = int8_shard(p.numel, env_.program.world, env_.program.rank);
        r->shard_residual_at = residuals_;
        residuals_ += mine.hi - mine.lo;
      }
    }
    size_t& need = staging_need[static_cast<size_t>(p.stream)];
    const size_t bytes = stage_bytes(p);
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
  alloc_int8();
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

// The int8 wire's memory: the kept rounding errors of every int8 bucket (zero: nothing owed yet; a
// new plan starts afresh) and one exchange buffer per stream, as large as its largest bucket needs
// (a host stream runs its buckets one after another): world chunks to all-gather (two rounds' worth
// when it goes in rounds), or (scatter) world shards to send and world to receive.
void Reducer::alloc_int8() {
  std::vector<size_t> need(env_.streams.size(), 0);
  for (const BucketProgram& p : program_.buckets) {
    size_t& n = need[static_cast<size_t>(p.stream)];
    n = std::max(n, p.int8_chunk * static_cast<size_t>(env_.program.world) * (p.int8_scatter || p.int8_piece ? 2 : 1));
  }
  for (void* p : gather_) env_.device->release(p);
  env_.device->release(residual_);
  gather_.assign(need.size(), nullptr);
  residual_ = residuals_ ? static_cast<float*>(env_.device->alloc(residuals_ * sizeof(float))) : nullptr;
  int8_bytes_ = residuals_ * sizeof(float);
  for (size_t s = 0; s < need.size(); ++s) {
    if (need[s]) gather_[s] = env_.device->alloc(need[s]);
    int8_bytes_ += need[s];
  }
}

// Zeros in each int8 bucket's stream order (the residuals may be device memory). What this rank owes
// for its own contribution only: a scatter bucket's shard errors belong to the sum of every rank's
// contributions, which this rank still re-quantizes.
void Reducer::clear_feedback() {
  for (size_t b = 0; b < rt_.size(); ++b) {
    const BucketProgram& p = program_.buckets[b];
    if (p.collective == Collective::Int8)
      env_.device->fill_zero(residual_ + rt_[b]->residual_at, p.numel, Dtype::F32, stream_of(static_cast<int>(b)));
  }
}

// The int8 wire: this rank's chunk (its values plus its kept errors, quantized) into its place in the
// stream's gather buffer, every rank's chunk to every rank, and the same rank-order sum everywhere.
void Reducer::int8_allreduce(int b, void* buf, size_t n) {
  auto [p, r, s, d, c] = work(b);
  if (p.int8_scatter) return int8_scatter_allreduce(b, buf, n);
  if (p.int8_piece) return int8_gather_rounds(b, buf, n);
  char* all = static_cast<char*>(gather_[static_cast<size_t>(p.stream)]);
  d.int8_quantize(buf, p.dtype, n, residual_ + r.residual_at,
                  all + static_cast<size_t>(env_.program.rank) * p.int8_chunk, s);
  c.allgather(all, p.int8_chunk, s, Deadline::after_ms(env_.timeout_ms));
  d.int8_dequant_sum(all, p.int8_chunk, env_.program.world, n, p.dtype, buf, s);
}

// The all-gather in rounds of p.int8_piece elements (whole blocks, so the bits are those of the
// whole bucket's): round k's chunks in one of two halves of the stream's buffer, alternately, so
// that the comm can quantize round k + 1 and sum round k - 1 while round k is on the wire. Each round
// quantizes straight from the grads (copy layout) or the arena, pre-scaled on the way, and sums
// straight into them, post-scaled on the way, a cache-sized tile at a time
// (Device::int8_quantize_grads): the passes step_in and step_out leave to it cost no memory pass.
void Reducer::int8_gather_rounds(int b, void* buf, size_t n) {
  struct Rounds final : AllgatherRounds {
    Device* d;
    Stream* s;
    const BucketProgram* p;
    SegmentTable* table;  // the grads (copy layout), or the arena's bucket as one segment
    char* all;
    float* residual;
    size_t n;
    int world, rank;
    size_t count() override { return (n + p->int8_piece - 1) / p->int8_piece; }
    char* buffer(size_t k) override { return all + (k % 2) * p->int8_chunk * static_cast<size_t>(world); }
    size_t bytes(size_t k) override { return elem::int8_chunk_bytes(len(k)); }
    size_t len(size_t k) const { return std::min(p->int8_piece, n - k * p->int8_piece); }
    Span span(size_t k) const { return Span{k * p->int8_piece, k * p->int8_piece + len(k)}; }
    void fill(size_t k) override {
      d->int8_quantize_grads(*table, p->dtype, p->pre, span(k), residual + span(k).lo,
                             buffer(k) + static_cast<size_t>(rank) * bytes(k), *s);
    }
    void done(size_t k) override {
      d->int8_dequant_grads(buffer(k), bytes(k), world, span(k), *table, p->dtype, p->post, *s);
    }
  };
  auto [p, r, s, d, c] = work(b);
  SegmentTable arena;
  Rounds rounds;
  rounds.d = &d;
  rounds.s = &s;
  rounds.p = &p;
  rounds.table = &grads_table(p, r, buf, n, &arena);
  rounds.all = static_cast<char*>(gather_[static_cast<size_t>(p.stream)]);
  rounds.residual = residual_ + r.residual_at;
  rounds.n = n;
  rounds.world = env_.program.world;
  rounds.rank = env_.program.rank;
  c.allgather_rounds(rounds, s, Deadline::after_ms(env_.timeout_ms));
}

// The int8 wire as a reduce-scatter: the bucket is cut into world shards of whole blocks
// (int8_shard); each rank quantizes every shard with its kept errors (the same blocks, the same bits
// as the all-gather's chunk), sends shard j to rank j, sums the world chunks of its own shard in rank
// order, re-quantizes that sum with errors kept for it, and all-gathers the re-quantized shards, which
// every rank (the owner too) dequantizes: the same bits everywhere. Each exchange moves (world - 1)
// shard chunks each way, so the bytes stay about a quarter of fp32's ring at any world size.
void Reducer::int8_scatter_allreduce(int b, void* buf, size_t n) {
  auto [p, r, s, d, c] = work(b);
  const int world = env_.program.world, me = env_.program.rank;
  const size_t es = dtype_size(p.dtype), chunk = p.int8_chunk;
  const bool direct = int8_reads_grads(p);  // else step_in packed (or scaled) the bucket into buf
  SegmentTable arena;
  SegmentTable* grads = direct ? &grads_table(p, r, buf, n, &arena) : nullptr;
  char* x = static_cast<char*>(buf);
  char* send = static_cast<char*>(gather_[static_cast<size_t>(p.stream)]);
  char* recv = send + static_cast<size_t>(world) * chunk;
  const Deadline dl = Deadline::after_ms(env_.timeout_ms);
  for (int j = 0; j < world; ++j) {
    const Span sh = int8_shard(n, world, j);
    float* res = residual_ + r.residual_at + sh.lo;
    char* to = send + static_cast<size_t>(j) * chunk;
    if (direct)
      d.int8_quantize_grads(*grads, p.dtype, p.pre, sh, res, to, s);
    else
      d.int8_quantize(x + sh.lo * es, p.dtype, sh.hi - sh.lo, res, to, s);
  }
  c.alltoall(send, recv, chunk, s, dl);
  // The shard's sum, before its re-quantization, in the bucket's buffer, which no quantization reads
  // any more: the arena at the shard's place, the staging buffer (which holds nothing else: the grads
  // are read and written where they lie) from its start, or at the shard's place where step_in packed.
  const Span mine = int8_shard(n, world, me);
  char* own = direct && p.staged ? x : x + mine.lo * es;
  d.int8_dequant_sum(recv, chunk, world, mine.hi - mine.lo, p.dtype, own, s);
  d.int8_quantize(own, p.dtype, mine.hi - mine.lo, residual_ + r.shard_residual_at,
                  send + static_cast<size_t>(me) * chunk, s);
  c.allgather(send, chunk, s, dl);
  for (int j = 0; j < world; ++j) {
    const Span sh = int8_shard(n, world, j);
    const char* from = send + static_cast<size_t>(j) * chunk;
    if (direct)
      d.int8_dequant_grads(from, chunk, 1, sh, *grads, p.dtype, p.post, s);
    else
      d.int8_dequant_sum(from, chunk, 1, sh.hi - sh.lo, p.dtype, x + sh.lo * es, s);
  }
}

// The int8 collectives that read the grads and write the results themselves, pre- and post-scaling
// on the way (host devices: the rounds and the reduce-scatter), so that step_in and step_out leave
// the bucket alone. Elsewhere (GPUs) step_in packs and step_out unpacks as for any bucket.
bool Reducer::int8_reads_grads(const BucketProgram& p) const {
  return p.collective == Collective::Int8 && (p.int8_piece || p.int8_scatter) && env_.device->memory() == Memory::Host;
}

// The staging bucket `p` needs (bytes): the program's, except where the int8 collectives read and
// write the grads themselves: none for the rounds, this rank's shard of sums for the reduce-scatter.
size_t Reducer::stage_bytes(const BucketProgram& p) const {
  if (!p.staged || !int8_reads_grads(p)) return p.stage_bytes;
  if (!p.int8_scatter) return 0;
  const Span mine = int8_shard(p.numel, env_.program.world, env_.program.rank);
  return (mine.hi - mine.lo) * dtype_size(p.dtype);
}

// What the int8 collectives that read the grads themselves work on: the grads (copy layout), or the
// arena's bucket `buf` as one segment (*arena; step_in zeroed its unused grads).
SegmentTable& Reducer::grads_table(const BucketProgram& p, BucketRt& r, void* buf, size_t n, SegmentTable* arena) {
  if (p.staged) return r.packed;
  arena->segs.assign(1, Segment{buf, 0, n, 0});
  return *arena;
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

// Staged: one pass in, casting and pre-scaling into the staging buffer (in-place grads: their zeros or
// pre-scale). In place (arena): zeros for unused grads, and the pre-scale if the engine cannot fuse it.
void Reducer::step_in(int b) {
  auto [p, r, s, d, c] = work(b);
  r.start_ns = now_ns();
  if (int8_reads_grads(p)) {
    if (!p.staged)
      for (Segment& seg : r.packed.segs)
        if (seg.zero) d.fill_zero(seg.ptr, seg.numel, p.dtype, s);
    return;
  }
  if (p.staged) {
    if (!r.packed.segs.empty()) d.pack(r.packed, p.dtype, staging(b), p.wire, p.pre, Span{0, p.packed}, s);
    for (Segment& seg : r.direct.segs) {
      if (seg.zero)
        d.fill_zero(seg.ptr, seg.numel, p.dtype, s);
      else
        d.scale(seg.ptr, seg.numel, p.dtype, p.pre, s);
    }
  } else {
    for (Segment& seg : r.packed.segs)
      if (seg.zero) d.fill_zero(seg.ptr, seg.numel, p.dtype, s);
    d.scale(r.base, p.numel, p.dtype, p.pre, s);
  }
}

// The bucket's collectives: its buffer, and each in-place grad, as one group when several (and
// `own_group`: a grouped launch already brackets them).
void Reducer::step_collectives(int b, bool own_group) {
  auto [p, r, s, d, c] = work(b);
  const Deadline dl = Deadline::after_ms(env_.timeout_ms);
  void* buf = buffer(b);
  const size_t n = p.staged ? p.packed : p.numel;
  switch (p.collective) {
    case Collective::Hook:  // the caller's reduction of the whole bucket (never sharded, never in place)
      // The user's function runs as a blocking call on `s` (ddp_set_comm_hook's wrapper), bounded by
      // timeout_ms like a blocked collective.
      return env_.hook(HookCall{b, p.stream, iteration_, buf, n, p.wire, &s, &c, dl});
    case Collective::Int8: return int8_allreduce(b, buf, n);
    case Collective::ReduceScatter: return c.reduce_scatter(buf, p.shard_n, p.wire, p.red, s, dl);
    case Collective::AllReduce: break;
  }
  const bool packed = !p.staged || !r.packed.segs.empty();
  const bool group = own_group && (packed ? 1u : 0u) + r.direct.segs.size() > 1;
  if (group) c.group_start();
  if (packed) allreduce(p, c, s, buf, buf, n, p.wire, dl);
  for (Segment& seg : r.direct.segs) allreduce(p, c, s, seg.ptr, seg.ptr, seg.numel, p.dtype, dl);
  if (group) c.group_end();
}

// One pass out (unpack or the post-scale of the program's out span), the optional finiteness scan,
// and the bucket's accounting.
void Reducer::step_out(int b) {
  auto [p, r, s, d, c] = work(b);
  if (p.staged) {
    // Sharded: the whole staging buffer goes back (outside the shard the values are unspecified
    // anyway), but only the shard is scanned. The int8 rounds and scatter wrote the grads already.
    if (!r.packed.segs.empty() && !int8_reads_grads(p))
      d.unpack(staging(b), p.wire, r.packed, p.dtype, p.post, Span{0, p.packed}, s);
    for (Segment& seg : r.direct.segs) d.scale(seg.ptr, seg.numel, p.dtype, p.post, s);
    size_t cursor = 0;
    scan_packed(b, p.out, &cursor);
    for (const Segment& seg : r.direct.segs) scan(b, seg.ptr, seg.numel);
  } else {
    char* mine = r.base + p.out.lo * dtype_size(p.dtype);
    if (!int8_reads_grads(p)) d.scale(mine, p.out.hi - p.out.lo, p.dtype, p.post, s);
    scan(b, mine, p.out.hi - p.out.lo);
  }
  account(b);
}

void Reducer::scan(int b, const void* p, size_t n) {
  if (env_.check_finite)
    env_.device->scan_nonfinite(p, n, program_.buckets[static_cast<size_t>(b)].dtype, static_cast<size_t>(b),
                                stream_of(b));
}

// Scans the grads (in their own dtype: a cast back to 16 bits can overflow) that the packed elements
// `span` went back to. Spans come in increasing order; *cursor is the first segment not yet passed.
void Reducer::scan_packed(int b, Span span, size_t* cursor) {
  if (!env_.check_finite) return;
  const BucketRt& r = *rt_[static_cast<size_t>(b)];
  const size_t es = dtype_size(program_.buckets[static_cast<size_t>(b)].dtype);
  for (size_t i = *cursor; i < r.packed.segs.size(); ++i) {
    const Segment& seg = r.packed.segs[i];
    if (seg.offset >= span.hi) break;
    const size_t a = std::max(span.lo, seg.offset), e = std::min(span.hi, seg.offset + seg.numel);
    if (a < e) scan(b, static_cast<const char*>(seg.ptr) + (a - seg.offset) * es, e - a);
    if (seg.offset + seg.numel <= span.hi) *cursor = i + 1;
  }
}

void Reducer::account(int b) {
  BucketRt& r = *rt_[static_cast<size_t>(b)];
  const BucketProgram& p = program_.buckets[static_cast<size_t>(b)];
  const uint64_t t1 = now_ns();
  Stats& k = *env_.stats;
  k.buckets_reduced.fetch_add(1, std::memory_order_relaxed);
  // GPU streams only enqueued the work: they count the bucket done when it completes.
  const bool later = !workers_ && stream_of(b).finishes_later(b, &env_.progress->done);
  if (!later) env_.progress->done.fetch_add(1, std::memory_order_relaxed);
  k.bytes_reduced.fetch_add(p.wire_bytes, std::memory_order_relaxed);
  if (workers_) k.comm_time_ns.fetch_add(t1 - r.launch_ns, std::memory_order_relaxed);
  if (env_.timeline)
    env_.timeline->bucket(b, p.stream, iteration_, r.ready_ns, r.launch_ns, r.start_ns, t1, r.size, p.wire_bytes);
  r.done = !later;
}

// Host pieces: each piece goes in (pack, or the pre-scale), through its collective and out (unpack
// or the post-scale, the finiteness scan) before the next one, so every pass but the collective's
// own touches data still in cache: no whole-bucket pass before or after the collective.
void Reducer::pieces(int b) {
  auto [p, r, s, d, c] = work(b);
  r.start_ns = now_ns();
  if (!p.staged) {
    for (Segment& seg : r.packed.segs)
      if (seg.zero) d.fill_zero(seg.ptr, seg.numel, p.dtype, s);
    reduce_in_place(b, r.base, p.numel);
  } else {
    char* st = static_cast<char*>(staging(b));
    const size_t ws = dtype_size(p.wire);
    const Deadline dl = Deadline::after_ms(env_.timeout_ms);
    size_t cursor = 0, walk = 0;
    for (size_t lo = 0; lo < p.packed; lo += p.piece) {
      const Span sp{lo, std::min(p.packed, lo + p.piece)};
      const void* from = direct_source(p, r, sp, &walk);
      if (!from) {
        d.pack(r.packed, p.dtype, st, p.wire, p.pre, sp, s);
        from = st + lo * ws;
      }
      allreduce(p, c, s, from, st + lo * ws, sp.hi - lo, p.wire, dl);
      d.unpack(st, p.wire, r.packed, p.dtype, p.post, sp, s);
      scan_packed(b, sp, &cursor);
    }
    for (Segment& seg : r.direct.segs) {
      if (seg.zero) d.fill_zero(seg.ptr, seg.numel, p.dtype, s);
      reduce_in_place(b, seg.ptr, seg.numel);
    }
  }
  account(b);
}

// Where a packed piece can be sent from without packing it: inside one used grad, when the pack
// would neither cast nor scale. The collective then reads the grad and writes the staging buffer,
// and the unpack brings the sum back: one pass fewer. Not when the caller forbade collectives on its
// grads (inplace_min_numel SIZE_MAX). *seg walks the segments as the spans advance.
const void* Reducer::direct_source(const BucketProgram& p, const BucketRt& r, Span sp, size_t* seg) const {
  if (p.wire != p.dtype || p.pre != 1.0 || env_.program.inplace_min_numel == SIZE_MAX) return nullptr;
  const std::vector<Segment>& segs = r.packed.segs;
  while (*seg < segs.size() && segs[*seg].offset + segs[*seg].numel <= sp.lo) ++*seg;
  if (*seg == segs.size()) return nullptr;
  const Segment& g = segs[*seg];
  if (g.zero || g.offset > sp.lo || g.offset + g.numel < sp.hi) return nullptr;
  return static_cast<const char*>(g.ptr) + (sp.lo - g.offset) * dtype_size(p.dtype);
}

// An in-place range (an arena bucket, a grad reduced in place) in pieces, each scaled before and
// after its collective while in cache.
void Reducer::reduce_in_place(int b, void* ptr, size_t n) {
  auto [p, r, s, d, c] = work(b);
  const size_t es = dtype_size(p.dtype);
  const Deadline dl = Deadline::after_ms(env_.timeout_ms);
  for (size_t lo = 0; lo < n; lo += p.piece) {
    char* at = static_cast<char*>(ptr) + lo * es;
    const size_t k = std::min(p.piece, n - lo);
    d.scale(at, k, p.dtype, p.pre, s);
    allreduce(p, c, s, at, at, k, p.dtype, dl);
    d.scale(at, k, p.dtype, p.post, s);
    scan(b, at, k);
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
