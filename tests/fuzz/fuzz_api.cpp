// A fuzzer over the whole C API. The input bytes are a small program: a config (valid or not), a world
// of 1 (ddp_comm_init_self) or 2 in-process ranks (a local group, one thread per rank), then a
// sequence of calls: register, commit, begin, ready (random order, repeats, bad indices), moved grad
// pointers, finish, set_sync, reduce_all, plan and stats queries, broadcast, synchronize; destroy last.
//
// Besides crashes, leaks, hangs and sanitizer reports, the harness checks what the library answers
// against a model of the API:
//   - every call's status is the one the header promises for the state the model is in;
//   - in a world of 2, both ranks get the same status from every call;
//   - after a synced finish or reduce_all every grad holds the exact reduction of what each rank
//     gave (0 for a grad a rank never marked ready), scaled as configured; NaN and Inf travel
//     unchanged, and check_finite counts them;
//   - the plan covers every grad once, with the right element counts.
// A disagreement prints what differed and aborts, which the fuzzer reports as a finding.
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "../support/exact_grads.hpp"
#include "ddp.h"

namespace {

// ---- input -----------------------------------------------------------------------------------

struct Bytes {
  const uint8_t* p;
  size_t n;
  uint8_t u8() {
    if (!n) return 0;
    --n;
    return *p++;
  }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
  bool empty() const { return n == 0; }
};

enum Op {
  OP_REGISTER,
  OP_COMMIT,
  OP_BEGIN,
  OP_READY,
  OP_READY_REST,
  OP_READY_PTR,
  OP_SET_PTR,
  OP_FINISH,
  OP_SET_SYNC,
  OP_REDUCE_ALL,
  OP_PLAN,
  OP_STATS,
  OP_GRAD_PTR,
  OP_NONFINITE,
  OP_SYNCHRONIZE,
  OP_BROADCAST,
  OP_ITERATION,
  OP_LOG,
  OP_SHARD_QUERY,  // sharded contexts (and their refusal elsewhere): ddp_get_shard, ddp_grad_shard, ddp_param_ptr
  OP_GATHER,       // writes this rank's parameter shards, gathers, waits, checks every rank's values
  OP_WAIT,         // ddp_wait_params of one grad (or -1)
  OP_NORM,         // ddp_shard_norm against the model's reduced values
  OP_COUNT
};

// Log callbacks the fuzzer switches between (OP_LOG); they only count.
std::atomic<uint64_t> g_log_calls{0};
extern "C" void fuzz_log_a(ddp_log_level_t, const char* msg, void*) {
  if (msg && *msg) g_log_calls.fetch_add(1, std::memory_order_relaxed);
}
extern "C" void fuzz_log_b(ddp_log_level_t level, const char*, void* user) {
  if (user && level == DDP_LOG_WARN) g_log_calls.fetch_add(1, std::memory_order_relaxed);
}

struct Call {
  int op;
  uint8_t a, b, c, d;
};

constexpr int kMaxGrads = 24;
constexpr size_t kMaxNumel = 700;
constexpr size_t kMaxCalls = 160;

// ---- element storage (the tests' own conversions, independent of the library's) ----------------

size_t esize(int dt) { return faults::esize(static_cast<ddp_dtype_t>(dt)); }
double load(const void* p, size_t i, int dt) { return faults::load(p, i, static_cast<ddp_dtype_t>(dt)); }
void store(void* p, size_t i, int dt, double v) { faults::store(p, i, static_cast<ddp_dtype_t>(dt), v); }

// ---- lockstep of the ranks -------------------------------------------------------------------

class Lockstep {
 public:
  explicit Lockstep(int n) : n_(n) {}
  void wait() {
    if (n_ == 1) return;
    std::unique_lock<std::mutex> lock(mu_);
    uint64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  int n_;
  int count_ = 0;
  uint64_t gen_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
};

// ---- the program both ranks run ----------------------------------------------------------------

enum class St { Open, Idle, InBackward };

struct Program {
  int world = 1;
  int diverge = 0;        // world 2: 0 none, 1 message_size, 2 num_streams, 3 a grad's numel, 4 plan
  int diverge_grad = -1;  // the grad whose numel differs on rank 1
  bool stream_comms = false;
  ddp_config_t cfg;
  bool cfg_valid = true;
  uint8_t seed = 0;
  std::vector<Call> calls;
  std::vector<unsigned> perm_seed;  // rank 1 marks grads through a permutation
  const char* knob = nullptr;       // an environment knob set for this input (edge cases), and its value
  const char* knob_value = nullptr;
};

struct Grad {
  size_t numel = 0;
  int dtype = 0;
  int index = -1;
  std::vector<unsigned char> buf[2];  // copy layout: the two places it lives in turn
  int cur = 0;
  std::vector<double> val;  // what the harness believes the grad holds
  bool ready = false;
};

// What each rank publishes for the other's checks.
struct RankView {
  ddp_status_t status = DDP_SUCCESS;
  std::vector<std::vector<double>> contrib;  // per grad: what this rank gave to the last reduction
  std::vector<char> given;                   // per grad: whether it gave it (ready or reduce_all)
  uint64_t nonfinite = 0;
};

struct Shared {
  Program prog;
  Lockstep step;
  RankView view[2];
  ddp_local_group_t group = nullptr;
  explicit Shared(int n) : step(n) {}
};

[[noreturn]] void finding(int rank, size_t call, const char* what) {
  std::fprintf(stderr, "FINDING (rank %d, call %zu): %s\n", rank, call, what);
  std::fflush(stderr);
  std::abort();
}

const char* st_name(ddp_status_t s) { return ddp_status_string(s); }

double fill_value(uint8_t seed, int rank, uint64_t iter, int g, size_t i) {
  uint64_t h = (static_cast<uint64_t>(seed) << 40) ^ (static_cast<uint64_t>(rank) << 32) ^ (iter << 20) ^
               (static_cast<uint64_t>(g) << 12) ^ i;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 29;
  return static_cast<double>(static_cast<int>(h % 17) - 8);  // exact in every dtype
}

class Rank {
 public:
  Rank(Shared& sh, int rank) : sh_(sh), p_(sh.prog), rank_(rank) {}
  void run();

 private:
  void expect(size_t k, ddp_status_t got, ddp_status_t want, const char* call);
  bool committing_ok();  // the model's answer to an implicit commit
  void* ptr_of(Grad& g);
  void fill_all(uint64_t iter);
  void check_values(size_t k, bool reduce_all);
  void check_plan(size_t k);
  void shard_query(size_t k, const Call& c, int idx, bool bad_idx);
  void gather(size_t k);
  void norm(size_t k);
  ddp_status_t commit_status();
  void agree(size_t k);

  Shared& sh_;
  const Program& p_;
  int rank_;
  ddp_comm_t comm_ = nullptr;
  std::vector<ddp_comm_t> extra_;
  ddp_t d_ = nullptr;
  St st_ = St::Open;
  bool aborted_ = false;
  bool sync_ = true;
  bool iter_sync_ = true;
  bool arena_ = false;
  bool zero_policy_ = false;
  bool check_finite_ = false;
  bool nonfinite_next_ = false;
  bool sharded_ = false;
  bool gathered_ = false;      // a gather since the last reduction
  bool shards_local_ = false;  // the last backward accumulated with sync off
  bool fresh_ = false;         // the grads hold the last reduction's values (no fill since)
  std::vector<Grad> grads_;
  uint64_t iter_ = 0, fills_ = 0;
  uint64_t nonfinite_seen_ = 0;
  std::vector<int> perm_;
};

const bool g_trace = std::getenv("DDP_FUZZ_TRACE") != nullptr;

void Rank::expect(size_t k, ddp_status_t got, ddp_status_t want, const char* call) {
  sh_.view[rank_].status = got;
  if (g_trace)
    std::fprintf(stderr, "[rank %d] %zu %s -> %s%s%s\n", rank_, k, call, st_name(got), got ? ": " : "",
                 got ? ddp_last_error() : "");
  if (got != want) {
    char msg[1024];
    std::snprintf(msg, sizeof msg, "%s returned %s, the model expected %s (last error: %s)", call, st_name(got),
                  st_name(want), ddp_last_error());
    finding(rank_, k, msg);
  }
  if (got != DDP_SUCCESS && ddp_last_error()[0] == '\0') finding(rank_, k, "a failed call left no message");
}

// Both ranks must answer every call alike.
void Rank::agree(size_t k) {
  sh_.step.wait();
  if (p_.world == 2 && rank_ == 0 && sh_.view[0].status != sh_.view[1].status) {
    char msg[256];
    std::snprintf(msg, sizeof msg, "ranks got different statuses: %s on rank 0, %s on rank 1",
                  st_name(sh_.view[0].status), st_name(sh_.view[1].status));
    finding(0, k, msg);
  }
  sh_.step.wait();
}

// Closing registration: rank disagreement is MISMATCH and aborts the context.
ddp_status_t Rank::commit_status() {
  if (st_ != St::Open) return DDP_SUCCESS;
  if (p_.diverge) {
    aborted_ = true;
    return DDP_ERR_MISMATCH;
  }
  st_ = St::Idle;
  return DDP_SUCCESS;
}

void* Rank::ptr_of(Grad& g) {
  if (!arena_) return g.buf[g.cur].data();
  void* p = nullptr;
  ddp_status_t s = ddp_grad_ptr(d_, g.index, &p);
  if (s != DDP_SUCCESS || !p) finding(rank_, 0, "ddp_grad_ptr failed on a committed arena context");
  return p;
}

void Rank::fill_all(uint64_t iter) {
  for (size_t gi = 0; gi < grads_.size(); ++gi) {
    Grad& g = grads_[gi];
    void* p = ptr_of(g);
    for (size_t i = 0; i < g.numel; ++i) {
      double v = fill_value(p_.seed, rank_, iter, static_cast<int>(gi), i);
      if (nonfinite_next_ && rank_ == 0 && i == 0 && gi == iter % grads_.size()) v = (iter & 1) ? INFINITY : NAN;
      g.val[i] = v;
      store(p, i, g.dtype, v);
    }
  }
  nonfinite_next_ = false;
  fresh_ = false;
}

double scale_of(const ddp_config_t& c, int world) {
  return c.gradient_average ? 1.0 / world : 1.0 / c.gradient_predivide_factor;
}

// After a synced reduction: every grad = scale * sum of what the ranks gave.
void Rank::check_values(size_t k, bool reduce_all) {
  RankView& me = sh_.view[rank_];
  me.contrib.resize(grads_.size());
  me.given.assign(grads_.size(), 0);
  for (size_t gi = 0; gi < grads_.size(); ++gi) {
    me.contrib[gi] = grads_[gi].val;
    me.given[gi] = reduce_all || grads_[gi].ready;
  }
  sh_.step.wait();  // both views published
  const double sc = scale_of(p_.cfg, p_.world);
  bool any_nonfinite = false;
  gathered_ = false;
  shards_local_ = false;
  for (size_t gi = 0; gi < grads_.size(); ++gi) {
    Grad& g = grads_[gi];
    void* p = ptr_of(g);
    size_t first = 0, count = g.numel;  // sharded: only the elements this rank owns are reduced
    if (sharded_ && ddp_grad_shard(d_, g.index, &first, &count, nullptr) != DDP_SUCCESS)
      finding(rank_, k, "ddp_grad_shard failed on a committed sharded context");
    for (size_t i = 0; i < g.numel; ++i) {
      double sum = 0;
      for (int r = 0; r < p_.world; ++r)
        if (sh_.view[r].given[gi]) sum += sh_.view[r].contrib[gi][i];
      // Scaling happens in two steps (1/f before, f/world after) unless fused, so allow rounding.
      double want = sum * sc, got = load(p, i, g.dtype);
      g.val[i] = want;
      if (i < first || i >= first + count) continue;
      bool ok;
      if (std::isnan(want))
        ok = std::isnan(got);
      else if (std::isinf(want))
        ok = got == want;
      else {
        double tol = g.dtype == DDP_F64 ? 1e-12 : g.dtype == DDP_F32 ? 1e-6 : g.dtype == DDP_F16 ? 2e-3 : 1.6e-2;
        ok = std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
      }
      if (!std::isfinite(want)) any_nonfinite = true;
      if (!ok) {
        char msg[256];
        std::snprintf(msg, sizeof msg, "grad %zu[%zu] (dtype %d) is %.17g after reduction, expected %.17g", gi, i,
                      g.dtype, got, want);
        finding(rank_, k, msg);
      }
    }
  }
  fresh_ = true;
  if (check_finite_) {
    ddp_stats_t s;
    std::memset(&s, 0, sizeof s);
    s.size = sizeof s;
    if (ddp_get_stats(d_, &s) != DDP_SUCCESS) finding(rank_, k, "ddp_get_stats failed");
    const bool counted = s.nonfinite_buckets > nonfinite_seen_;
    if (counted != any_nonfinite)
      finding(rank_, k,
              any_nonfinite ? "a bucket held NaN/Inf but check_finite did not count it"
                            : "check_finite counted a bucket that held only finite values");
    nonfinite_seen_ = s.nonfinite_buckets;
  }
  sh_.step.wait();  // both done reading the views
}

void Rank::check_plan(size_t k) {
  int nb = -1, learned = -1;
  ddp_status_t s = ddp_get_plan(d_, &nb, &learned);
  ddp_status_t want = aborted_ ? (st_ == St::Open ? DDP_ERR_ABORTED : DDP_SUCCESS) : commit_status();
  expect(k, s, want, "ddp_get_plan");
  if (s != DDP_SUCCESS) return;
  if (nb < 0 || (grads_.empty() ? nb != 0 : nb < 1)) finding(rank_, k, "ddp_get_plan: impossible bucket count");
  std::vector<int> seen(grads_.size(), 0);
  std::vector<int> members(grads_.size() + 1);
  for (int b = 0; b < nb; ++b) {
    ddp_bucket_info_t info;
    info.size = sizeof info;
    if (ddp_get_bucket(d_, b, &info, members.data(), members.size()) != DDP_SUCCESS)
      finding(rank_, k, "ddp_get_bucket failed for a bucket in range");
    if (info.num_grads < 1 || static_cast<size_t>(info.num_grads) > grads_.size())
      finding(rank_, k, "ddp_get_bucket: impossible grad count");
    if (info.stream < 0 || info.stream >= p_.cfg.num_streams || info.stream != b % p_.cfg.num_streams)
      finding(rank_, k, "ddp_get_bucket: bucket not on stream b % num_streams");
    size_t numel = 0;
    for (int j = 0; j < info.num_grads; ++j) {
      int g = members[static_cast<size_t>(j)];
      if (g < 0 || static_cast<size_t>(g) >= grads_.size()) finding(rank_, k, "ddp_get_bucket: grad out of range");
      if (seen[static_cast<size_t>(g)]++) finding(rank_, k, "a grad is in two buckets");
      if (grads_[static_cast<size_t>(g)].dtype != info.dtype) finding(rank_, k, "a bucket mixes dtypes");
      numel += grads_[static_cast<size_t>(g)].numel;
    }
    if (numel != info.numel) finding(rank_, k, "a bucket's numel is not the sum of its grads'");
  }
  for (size_t g = 0; g < grads_.size(); ++g)
    if (!seen[g]) finding(rank_, k, "a grad is in no bucket");
  ddp_bucket_info_t info;
  info.size = sizeof info;
  if (ddp_get_bucket(d_, nb, &info, nullptr, 0) != DDP_ERR_INVALID_ARGUMENT)
    finding(rank_, k, "ddp_get_bucket accepted a bucket out of range");
}

void Rank::run() {
  ddp_config_t cfg = p_.cfg;
  if (p_.world == 1) {
    if (ddp_comm_init_self(&comm_) != DDP_SUCCESS) finding(rank_, 0, "ddp_comm_init_self failed");
  } else if (ddp_comm_init_local(sh_.group, rank_, &comm_) != DDP_SUCCESS) {
    finding(rank_, 0, "ddp_comm_init_local failed");
  }
  if (rank_ == 1) {
    if (p_.diverge == 1) cfg.message_size = cfg.message_size + 1;
    if (p_.diverge == 2) cfg.num_streams = cfg.num_streams % 8 + 1;
    if (p_.diverge == 4) cfg.plan_order = !cfg.plan_order;
  }
  if (p_.stream_comms && p_.cfg_valid) {
    for (int i = 0; i < cfg.num_streams; ++i) {
      ddp_comm_t c = nullptr;
      ddp_status_t s = p_.world == 1 ? ddp_comm_init_self(&c) : ddp_comm_init_local(sh_.group, rank_, &c);
      if (s != DDP_SUCCESS) finding(rank_, 0, "making a stream communicator failed");
      extra_.push_back(c);
    }
    cfg.stream_comms = extra_.data();
  }
  arena_ = cfg.layout == DDP_LAYOUT_ARENA;
  sharded_ = cfg.shard != 0;
  zero_policy_ = cfg.unused_policy == DDP_UNUSED_ZERO;
  check_finite_ = cfg.check_finite != 0;
  ddp_status_t s = ddp_create(comm_, &cfg, &d_);
  // Configs that disagree are refused by ddp_create itself, or at the latest when registration closes.
  const bool cfg_diverges = p_.diverge == 1 || p_.diverge == 2 || p_.diverge == 4;
  expect(0, s,
         !p_.cfg_valid                             ? DDP_ERR_INVALID_ARGUMENT
         : (cfg_diverges && s == DDP_ERR_MISMATCH) ? DDP_ERR_MISMATCH
                                                   : DDP_SUCCESS,
         "ddp_create");
  if (s == DDP_ERR_MISMATCH && std::strstr(ddp_last_error(), p_.diverge == 1   ? "message_size"
                                                             : p_.diverge == 2 ? "num_streams"
                                                                               : "plan_order") == nullptr)
    finding(rank_, 0, "the mismatch message does not name the field that differs");
  agree(0);
  // The context holds its own duplicates: the comm may go now.
  ddp_comm_destroy(comm_);
  comm_ = nullptr;
  if (s == DDP_SUCCESS) {
    for (size_t k = 0; k < p_.calls.size(); ++k) {
      const Call& c = p_.calls[k];
      const int n = static_cast<int>(grads_.size());
      int idx = static_cast<int>(c.a % (n + 3)) - 1;  // -1 .. n+1: two bad indices
      if (c.b == 0xff) idx = (c.a & 1) ? INT32_MAX : INT32_MIN;
      const bool bad_idx = idx < 0 || idx >= n;
      // Rank 1 handles grads in another order (ready, moves): through a permutation.
      if (rank_ == 1 && !bad_idx) idx = perm_[static_cast<size_t>(idx)];
      switch (c.op) {
        case OP_REGISTER: {
          if (n >= kMaxGrads) break;
          Grad g;
          g.numel = 1 + (static_cast<size_t>(c.a) | (static_cast<size_t>(c.b) << 8)) % kMaxNumel;
          if (c.d == 0x80) g.numel = 0;
          if (c.d == 0x81) g.numel = SIZE_MAX / 2;
          g.dtype = c.c % 5;  // 4 is not a dtype
          unsigned flags = (c.d & 1) ? DDP_GRAD_TRIGGER : 0;
          if (c.d == 0x82) flags |= 4;
          const bool wrong_ptr = c.d == 0x83;
          // Copy layout: a pointer one byte off its dtype's alignment, the memory of the grad registered
          // last (aliased), or its last element (overlapping): refused, naming the grads.
          const bool misaligned = c.d == 0x84 && !arena_;
          const bool aliased = (c.d == 0x85 || c.d == 0x86) && !arena_ && n > 0;
          bool valid = g.numel >= 1 && g.numel <= kMaxNumel && g.dtype < 4 && flags <= DDP_GRAD_TRIGGER && !wrong_ptr &&
                       !misaligned && !aliased;
          if (rank_ == 1 && p_.diverge == 3 && valid && p_.diverge_grad == n) g.numel += 1;
          void* ptr = nullptr;
          if (!arena_ && g.numel <= kMaxNumel && g.dtype < 4) {
            for (auto& b : g.buf) b.assign(g.numel * esize(g.dtype), 0);
            ptr = g.buf[0].data();
          }
          if (wrong_ptr) ptr = arena_ ? static_cast<void*>(&g) : nullptr;
          if (ptr && misaligned) ptr = g.buf[0].data() + 1;
          if (ptr && aliased) {
            Grad& last = grads_.back();
            ptr = last.buf[last.cur].data() + (c.d == 0x86 ? (last.numel - 1) * esize(last.dtype) : 0);
          }
          int index = -7;
          ddp_status_t want = g.dtype >= 4      ? DDP_ERR_INVALID_ARGUMENT  // checked by the C shell, first
                              : aborted_        ? DDP_ERR_ABORTED
                              : st_ != St::Open ? DDP_ERR_INVALID_STATE
                              : valid           ? DDP_SUCCESS
                                                : DDP_ERR_INVALID_ARGUMENT;
          s = ddp_register_grad(d_, ptr, g.numel, static_cast<ddp_dtype_t>(g.dtype), flags, &index);
          expect(k, s, want, "ddp_register_grad");
          if (s == DDP_SUCCESS) {
            if (index != n) finding(rank_, k, "ddp_register_grad returned an index out of sequence");
            g.index = index;
            g.val.assign(g.numel, 0.0);
            grads_.push_back(std::move(g));
          }
          break;
        }
        case OP_COMMIT:
          s = ddp_commit(d_);
          expect(k, s, aborted_ ? DDP_ERR_ABORTED : commit_status(), "ddp_commit");
          break;
        case OP_BEGIN: {
          ddp_status_t want = aborted_                ? DDP_ERR_ABORTED
                              : st_ == St::InBackward ? DDP_ERR_INVALID_STATE
                                                      : commit_status();
          s = ddp_begin_backward(d_, nullptr);
          expect(k, s, want, "ddp_begin_backward");
          if (s == DDP_SUCCESS) {
            st_ = St::InBackward;
            iter_sync_ = sync_;
            for (Grad& g : grads_) g.ready = false;
            fill_all(fills_++);
          }
          break;
        }
        case OP_READY:
        case OP_READY_PTR: {
          const int g = idx;
          const bool with_ptr = c.op == OP_READY_PTR;
          ddp_status_t want = aborted_                               ? DDP_ERR_ABORTED
                              : st_ != St::InBackward                ? DDP_ERR_INVALID_STATE
                              : bad_idx                              ? DDP_ERR_INVALID_ARGUMENT
                              : grads_[static_cast<size_t>(g)].ready ? DDP_ERR_INVALID_STATE
                              : (with_ptr && arena_)                 ? DDP_ERR_INVALID_STATE
                                                                     : DDP_SUCCESS;
          void* np = nullptr;
          if (with_ptr && !bad_idx) {
            Grad& gr = grads_[static_cast<size_t>(g)];
            if (!arena_) {
              // Move the grad: its value goes along (only while the library does not own it).
              int other = 1 - gr.cur;
              if (want == DDP_SUCCESS) std::memcpy(gr.buf[other].data(), gr.buf[gr.cur].data(), gr.buf[0].size());
              np = gr.buf[other].data();
            } else {
              np = &gr;  // refused: the arena owns storage
            }
          }
          s = with_ptr ? ddp_grad_ready_ptr(d_, g, np) : ddp_grad_ready(d_, g);
          expect(k, s, want, with_ptr ? "ddp_grad_ready_ptr" : "ddp_grad_ready");
          if (s == DDP_SUCCESS) {
            Grad& gr = grads_[static_cast<size_t>(g)];
            gr.ready = true;
            if (with_ptr && !arena_) gr.cur = 1 - gr.cur;
          }
          break;
        }
        case OP_READY_REST: {
          // Mark the rest in an order drawn from the input (a different one on each rank).
          if (aborted_ || st_ != St::InBackward) break;
          // The set left unused is the same on both ranks (through rank 1's permutation); the order
          // in which the rest is marked differs.
          auto map = [&](int v) { return rank_ == 1 ? perm_[static_cast<size_t>(v)] : v; };
          std::vector<int> order;
          for (int v = 0; v < n; ++v)
            if (!grads_[static_cast<size_t>(map(v))].ready) order.push_back(v);
          uint32_t x = c.a * 2654435761u + c.b;
          for (size_t i = order.size(); i > 1; --i) {
            x = x * 1103515245u + 12345u;
            std::swap(order[i - 1], order[(x >> 8) % i]);
          }
          order.resize(c.c & 1 ? order.size() : order.size() / 2);  // sometimes leave some unused
          x += static_cast<uint32_t>(rank_) * 40503u;
          for (size_t i = order.size(); i > 1; --i) {
            x = x * 1103515245u + 12345u;
            std::swap(order[i - 1], order[(x >> 8) % i]);
          }
          for (int v : order) {
            const int g = map(v);
            s = ddp_grad_ready(d_, g);
            expect(k, s, DDP_SUCCESS, "ddp_grad_ready");
            grads_[static_cast<size_t>(g)].ready = true;
          }
          s = DDP_SUCCESS;
          sh_.view[rank_].status = s;
          break;
        }
        case OP_SET_PTR: {
          const bool null_ptr = c.c == 0;
          ddp_status_t want = aborted_   ? DDP_ERR_ABORTED
                              : bad_idx  ? DDP_ERR_INVALID_ARGUMENT
                              : arena_   ? DDP_ERR_INVALID_STATE
                              : null_ptr ? DDP_ERR_INVALID_ARGUMENT
                              : (st_ == St::InBackward && grads_[static_cast<size_t>(idx)].ready)
                                  ? DDP_ERR_INVALID_STATE
                                  : DDP_SUCCESS;
          void* np = nullptr;
          if (!bad_idx && !null_ptr) {
            Grad& gr = grads_[static_cast<size_t>(idx)];
            int other = 1 - gr.cur;
            if (!arena_ && want == DDP_SUCCESS)
              std::memcpy(gr.buf[other].data(), gr.buf[gr.cur].data(), gr.buf[0].size());
            np = arena_ ? static_cast<void*>(&gr) : gr.buf[other].data();
          }
          s = ddp_set_grad_ptr(d_, idx, np);
          expect(k, s, want, "ddp_set_grad_ptr");
          if (s == DDP_SUCCESS) grads_[static_cast<size_t>(idx)].cur ^= 1;
          break;
        }
        case OP_FINISH: {
          ddp_status_t want = aborted_ ? DDP_ERR_ABORTED : st_ != St::InBackward ? DDP_ERR_INVALID_STATE : DDP_SUCCESS;
          bool unused_anywhere = false;
          if (want == DDP_SUCCESS && iter_sync_ && !zero_policy_) {
            // The error policy reports a grad unused on any rank, on every rank.
            sh_.view[rank_].given.assign(grads_.size(), 0);
            for (size_t g = 0; g < grads_.size(); ++g) sh_.view[rank_].given[g] = grads_[g].ready;
            sh_.step.wait();
            for (int r = 0; r < p_.world; ++r)
              for (char gv : sh_.view[r].given) unused_anywhere |= !gv;
            sh_.step.wait();
            if (unused_anywhere) want = DDP_ERR_INVALID_STATE;
          }
          s = ddp_finish_backward(d_, nullptr);
          expect(k, s, want, "ddp_finish_backward");
          if (st_ == St::InBackward && !aborted_) {
            st_ = St::Idle;
            if (iter_sync_) {
              ++iter_;
              if (unused_anywhere && std::strstr(ddp_last_error(), "grad") == nullptr)
                finding(rank_, k, "the unused-grad report names no grad");
              check_values(k, false);
            } else {
              shards_local_ = true;
            }
          }
          break;
        }
        case OP_SET_SYNC: {
          ddp_status_t want = aborted_ ? DDP_ERR_ABORTED : st_ == St::InBackward ? DDP_ERR_INVALID_STATE : DDP_SUCCESS;
          s = ddp_set_sync(d_, c.a & 1);
          expect(k, s, want, "ddp_set_sync");
          if (s == DDP_SUCCESS) sync_ = c.a & 1;
          break;
        }
        case OP_REDUCE_ALL: {
          ddp_status_t want = aborted_ ? DDP_ERR_ABORTED : st_ == St::InBackward ? DDP_ERR_INVALID_STATE : DDP_SUCCESS;
          const bool fill = want == DDP_SUCCESS && (st_ != St::Open || !arena_);
          if (fill) fill_all(fills_++);
          if (want == DDP_SUCCESS) want = commit_status();
          s = ddp_reduce_all(d_, nullptr);
          expect(k, s, want, "ddp_reduce_all");
          if (s == DDP_SUCCESS) {
            ++iter_;
            check_values(k, true);
          }
          break;
        }
        case OP_PLAN: check_plan(k); break;
        case OP_STATS: {
          ddp_stats_t st;
          std::memset(&st, 0xab, sizeof st);
          st.size = (c.a & 1) ? sizeof st : 2 * sizeof(uint64_t);  // an older, smaller struct too
          s = ddp_get_stats(d_, &st);
          expect(k, s, DDP_SUCCESS, "ddp_get_stats");
          if (st.iterations != iter_) finding(rank_, k, "ddp_get_stats: wrong iteration count");
          if (st.size == sizeof st && (st.world_size != p_.world || st.rank != rank_))
            finding(rank_, k, "ddp_get_stats: wrong world size or rank");
          if (st.size != sizeof st) {
            const unsigned char* tail = reinterpret_cast<const unsigned char*>(&st) + 2 * sizeof(uint64_t);
            for (size_t i = 0; i < sizeof st - 2 * sizeof(uint64_t); ++i)
              if (tail[i] != 0xab) finding(rank_, k, "ddp_get_stats wrote past the caller's size");
          }
          break;
        }
        case OP_GRAD_PTR: {
          void* q = nullptr;
          ddp_status_t want = aborted_  ? DDP_ERR_ABORTED
                              : bad_idx ? DDP_ERR_INVALID_ARGUMENT
                              : arena_  ? commit_status()
                                        : DDP_SUCCESS;
          s = ddp_grad_ptr(d_, idx, &q);
          expect(k, s, want, "ddp_grad_ptr");
          if (s == DDP_SUCCESS && !arena_ &&
              q != grads_[static_cast<size_t>(idx)].buf[grads_[static_cast<size_t>(idx)].cur].data())
            finding(rank_, k, "ddp_grad_ptr does not return the grad's current pointer");
          if (s == DDP_SUCCESS && !q) finding(rank_, k, "ddp_grad_ptr returned NULL");
          break;
        }
        case OP_NONFINITE:
          nonfinite_next_ = true;
          s = DDP_SUCCESS;
          sh_.view[rank_].status = s;
          break;
        case OP_LOG:
          // Process-wide; any thread may set it at any time. Never NULL here: the default would
          // write the fuzzer's stall warnings to stderr.
          s = ddp_set_log_callback(c.a & 1 ? fuzz_log_a : fuzz_log_b, c.a & 2 ? &g_log_calls : nullptr);
          expect(k, s, DDP_SUCCESS, "ddp_set_log_callback");
          break;
        case OP_SYNCHRONIZE:
          // Mid-backward with peers, the launched buckets wait for ranks that are themselves waiting
          // here: that can only end at the timeout, so it is not asked for.
          if (p_.world == 2 && st_ == St::InBackward) break;
          s = ddp_synchronize(d_);
          expect(k, s, aborted_ ? DDP_ERR_ABORTED : DDP_SUCCESS, "ddp_synchronize");
          break;
        case OP_BROADCAST: {
          const int root = c.a % (p_.world + 1);  // == world: out of range
          double buf[8];
          float fb[5];
          for (int i = 0; i < 8; ++i) buf[i] = rank_ * 100 + i;
          for (int i = 0; i < 5; ++i) fb[i] = static_cast<float>(rank_ * 10 + i);
          void* bufs[2] = {buf, fb};
          size_t counts[2] = {8, 5};
          ddp_dtype_t types[2] = {DDP_F64, DDP_F32};
          ddp_status_t want = aborted_ ? DDP_ERR_ABORTED : root >= p_.world ? DDP_ERR_INVALID_ARGUMENT : DDP_SUCCESS;
          s = ddp_broadcast(d_, bufs, counts, types, 2, root, nullptr);
          expect(k, s, want, "ddp_broadcast");
          if (s == DDP_SUCCESS)
            for (int i = 0; i < 8; ++i)
              if (buf[i] != root * 100 + i || (i < 5 && fb[i] != static_cast<float>(root * 10 + i)))
                finding(rank_, k, "ddp_broadcast delivered wrong values");
          break;
        }
        case OP_ITERATION: {
          // A whole well-formed iteration, so that short inputs reach steady state.
          if (aborted_ || st_ == St::InBackward) break;
          ddp_status_t want = commit_status();
          s = ddp_begin_backward(d_, nullptr);
          expect(k, s, want, "ddp_begin_backward");
          if (s != DDP_SUCCESS) break;
          st_ = St::InBackward;
          iter_sync_ = sync_;
          for (Grad& g : grads_) g.ready = false;
          fill_all(fills_++);
          for (int j = n - 1; j >= 0; --j) {
            int g = rank_ == 1 ? perm_[static_cast<size_t>(j)] : j;
            s = ddp_grad_ready(d_, g);
            expect(k, s, DDP_SUCCESS, "ddp_grad_ready");
            grads_[static_cast<size_t>(g)].ready = true;
          }
          s = ddp_finish_backward(d_, nullptr);
          expect(k, s, DDP_SUCCESS, "ddp_finish_backward");
          st_ = St::Idle;
          if (iter_sync_) {
            ++iter_;
            check_values(k, false);
          } else {
            shards_local_ = true;
          }
          break;
        }
        case OP_SHARD_QUERY: shard_query(k, c, idx, bad_idx); break;
        case OP_GATHER: gather(k); break;
        case OP_WAIT: {
          const bool all = c.b & 1;  // -1: every bucket
          ddp_status_t want = aborted_          ? DDP_ERR_ABORTED
                              : !sharded_       ? DDP_ERR_INVALID_STATE
                              : bad_idx && !all ? DDP_ERR_INVALID_ARGUMENT
                              : !gathered_      ? DDP_ERR_INVALID_STATE
                                                : DDP_SUCCESS;
          s = ddp_wait_params(d_, all ? -1 : idx == -1 ? INT32_MIN : idx, nullptr);  // -1 would mean all
          expect(k, s, want, "ddp_wait_params");
          break;
        }
        case OP_NORM: norm(k); break;
      }
      agree(k);
      if (perm_.size() != grads_.size()) {
        // Rank 1's marking order: a permutation of the grads registered so far.
        perm_.resize(grads_.size());
        for (size_t i = 0; i < perm_.size(); ++i) perm_[i] = static_cast<int>(i);
        uint32_t x = p_.seed * 7919u + 17u;
        for (size_t i = perm_.size(); i > 1; --i) {
          x = x * 1103515245u + 12345u;
          std::swap(perm_[i - 1], perm_[(x >> 8) % i]);
        }
      }
    }
  }
  // destroy: in any state, mid-backward included; never hangs.
  s = ddp_destroy(d_);
  if (s != DDP_SUCCESS) finding(rank_, p_.calls.size(), "ddp_destroy failed");
  for (ddp_comm_t c : extra_) ddp_comm_destroy(c);
  if (ddp_destroy(nullptr) != DDP_SUCCESS || ddp_comm_destroy(nullptr) != DDP_SUCCESS)
    finding(rank_, 0, "a destroy function refused NULL");
}

// The shard queries: refused on unsharded contexts, bad indices refused, and the geometry sound.
void Rank::shard_query(size_t k, const Call& c, int idx, bool bad_idx) {
  const ddp_status_t off = aborted_ ? DDP_ERR_ABORTED : !sharded_ ? DDP_ERR_INVALID_STATE : DDP_SUCCESS;
  ddp_status_t s;
  if (c.b % 3 == 0) {
    size_t first = 0, count = 0, pos = 0;
    ddp_status_t want = off ? off : bad_idx ? DDP_ERR_INVALID_ARGUMENT : commit_status();
    s = ddp_grad_shard(d_, idx, &first, &count, &pos);
    expect(k, s, want, "ddp_grad_shard");
    if (s == DDP_SUCCESS && first + count > grads_[static_cast<size_t>(idx)].numel)
      finding(rank_, k, "ddp_grad_shard: the owned range leaves the grad");
  } else if (c.b % 3 == 1) {
    void* q = nullptr;
    ddp_status_t want = off ? off : bad_idx ? DDP_ERR_INVALID_ARGUMENT : commit_status();
    s = ddp_param_ptr(d_, idx, &q);
    expect(k, s, want, "ddp_param_ptr");
    if (s == DDP_SUCCESS && !q) finding(rank_, k, "ddp_param_ptr returned NULL");
  } else {
    ddp_status_t want = off ? off : commit_status();
    int nb = 0;
    if (want == DDP_SUCCESS && ddp_get_plan(d_, &nb, nullptr) != DDP_SUCCESS) finding(rank_, k, "ddp_get_plan failed");
    const int b = static_cast<int>(c.a % (nb + 2)) - 1;  // -1 and nb: out of range
    if (want == DDP_SUCCESS && (b < 0 || b >= nb)) want = DDP_ERR_INVALID_ARGUMENT;
    ddp_shard_info_t info;
    info.size = sizeof info;
    s = ddp_get_shard(d_, b, &info);
    expect(k, s, want, "ddp_get_shard");
    if (s == DDP_SUCCESS &&
        (info.bucket_numel != info.shard_numel * static_cast<size_t>(p_.world) ||
         info.shard_offset != info.shard_numel * static_cast<size_t>(rank_) || info.grads_numel > info.bucket_numel ||
         (info.shard_numel * esize(info.dtype)) % 256 != 0 || !info.grad_shard || !info.param_shard))
      finding(rank_, k, "ddp_get_shard: impossible shard geometry");
  }
}

// Each rank writes its parameter shards, gathers, waits for all, and must see every rank's values.
void Rank::gather(size_t k) {
  ddp_status_t want = aborted_                     ? DDP_ERR_ABORTED
                      : !sharded_                  ? DDP_ERR_INVALID_STATE
                      : st_ == St::InBackward      ? DDP_ERR_INVALID_STATE
                      : gathered_ || shards_local_ ? DDP_ERR_INVALID_STATE
                                                   : commit_status();
  std::vector<ddp_shard_info_t> shards;
  int nb = 0;
  if (want == DDP_SUCCESS && ddp_get_plan(d_, &nb, nullptr) != DDP_SUCCESS) finding(rank_, k, "ddp_get_plan failed");
  for (int b = 0; b < nb; ++b) {
    ddp_shard_info_t info;
    info.size = sizeof info;
    if (ddp_get_shard(d_, b, &info) != DDP_SUCCESS) finding(rank_, k, "ddp_get_shard failed");
    for (size_t j = 0; j < info.shard_numel; ++j) store(info.param_shard, j, info.dtype, rank_ * 64 + b + j % 16);
    shards.push_back(info);
  }
  ddp_status_t s = ddp_gather_params(d_, nullptr);
  expect(k, s, want, "ddp_gather_params");
  if (s != DDP_SUCCESS) return;
  gathered_ = true;
  s = ddp_wait_params(d_, -1, nullptr);
  expect(k, s, DDP_SUCCESS, "ddp_wait_params");
  for (int b = 0; b < nb; ++b) {
    const ddp_shard_info_t& info = shards[static_cast<size_t>(b)];
    const char* all = static_cast<const char*>(info.param_shard) - info.shard_offset * esize(info.dtype);
    for (size_t e = 0; e < info.bucket_numel; ++e)
      if (load(all, e, info.dtype) !=
          static_cast<double>((e / info.shard_numel) * 64 + b + (e % info.shard_numel) % 16))
        finding(rank_, k, "after ddp_gather_params a parameter does not hold its owner's value");
  }
}

// The norm over every rank's shards of the last reduction's values (the model's), NaN/Inf counted.
void Rank::norm(size_t k) {
  ddp_status_t want = aborted_                ? DDP_ERR_ABORTED
                      : !sharded_             ? DDP_ERR_INVALID_STATE
                      : st_ == St::InBackward ? DDP_ERR_INVALID_STATE
                                              : commit_status();
  double got = -1;
  uint64_t bad = 0;
  ddp_status_t s = ddp_shard_norm(d_, nullptr, &got, &bad);
  expect(k, s, want, "ddp_shard_norm");
  if (s != DDP_SUCCESS || !fresh_) return;
  double sq = 0;
  uint64_t nonfinite = 0;
  for (const Grad& g : grads_)
    for (double v : g.val) {
      if (std::isfinite(v))
        sq += v * v;
      else
        ++nonfinite;
    }
  if (nonfinite != bad || std::fabs(got - std::sqrt(sq)) > 2e-2 * std::sqrt(sq) + 1e-9)
    finding(rank_, k, "ddp_shard_norm disagrees with the reduced values");
}

Program parse(const uint8_t* data, size_t size) {
  Bytes in{data, size};
  Program p;
  const uint8_t mode = in.u8();
  p.world = (mode & 1) ? 2 : 1;
  p.stream_comms = (mode & 2) != 0;
  p.seed = in.u8();
  ddp_config_init(&p.cfg);
  ddp_config_t& c = p.cfg;
  const uint8_t m = in.u8();
  c.message_size = 1 + in.u16() % 4000;
  if (m & 1) c.message_size = 10000000;
  c.delay_allreduce = (m >> 1) & 1;
  c.layout = (m >> 2) & 1;
  c.plan_order = (m >> 3) & 1;
  c.allreduce_always_fp32 = (m >> 4) & 1;
  c.gradient_average = (m >> 5) & 1;
  c.unused_policy = (m >> 6) & 1;
  c.check_finite = (m >> 7) & 1;
  const uint8_t q = in.u8();
  static const double factors[8] = {1.0, 2.0, 0.5, 4.0, 0.25, 3.0, 1.0, 8.0};
  c.gradient_predivide_factor = factors[q & 7];
  c.num_streams = 1 + ((q >> 3) & 3);
  c.inplace_min_numel = (q & 0x20) ? 1 + in.u8() * 2 : 0;
  c.timeout_ms = p.world == 2 ? 3000 : 0;  // bounds a destroy in mid-backward (it waits for launched work)
  if (q & 0x40) c.timeline_path = "/tmp/libddp-fuzz-timeline.json";
  if (m & 0x80) c.stall_warning_ms = 1 + (q & 7) * 50;  // warnings go to the fuzzer's callbacks
  if (p.world == 2 && (q & 0x80)) p.diverge = 1 + in.u8() % 4;
  // Sharded when the layout and plan allow it, for odd seeds; a plan that differs on one rank would
  // be refused there before the agreement the other rank waits in.
  c.shard = c.layout == DDP_LAYOUT_ARENA && c.plan_order == DDP_PLAN_REGISTRATION && (p.seed & 1);
  if (c.shard && p.diverge == 4) p.diverge = 0;
  if (p.diverge == 3) p.diverge_grad = in.u8() % 8;
  // Now and then a field the library must refuse, or the edge of what it accepts.
  const uint8_t bad = in.u8();
  if (bad >= 0xe0 && bad < 0xf0) {
    // Valid but extreme: the largest bounds (clock arithmetic must saturate), one bucket for every
    // grad, nothing in place, the smallest and largest ring pieces, and the knobs at their limits or
    // unreadable (warned, then their defaults). A world of 2 keeps its finite timeout: it bounds a
    // destroy in mid-backward.
    static const char* const piece_values[] = {"4096", "1099511627776", "4095", "12k", "-1", "99999999999999999999"};
    switch (bad & 15) {
      case 0:
        if (p.world == 1) c.timeout_ms = static_cast<int64_t>(9.2e18);
        break;
      case 1: c.stall_warning_ms = static_cast<int64_t>(9.2e18); break;
      case 2: c.message_size = static_cast<size_t>(9007199254740992.0); break;
      case 3: c.inplace_min_numel = SIZE_MAX; break;
      case 4: c.host_piece_bytes = 4096; break;
      case 5: c.host_piece_bytes = static_cast<size_t>(9007199254740992.0); break;
      case 6: c.num_streams = 64, c.message_size = 1, p.stream_comms = false; break;
      case 7: c.inplace_min_numel = 1; break;
      case 8:
      case 9:
      case 10:
      case 11:
      case 12:
      case 13: p.knob = "DDP_HOST_PIECE_BYTES", p.knob_value = piece_values[(bad & 15) - 8]; break;
      // (DDP_HOST_SIMD is left out: the library reads it once per process, so a per-input value
      // would test nothing.)
      case 14: p.knob = "DDP_HOST_PIECE_BYTES", p.knob_value = ""; break;
      case 15: p.knob = "DDP_HOST_PIECE_BYTES", p.knob_value = " 4096"; break;
    }
  }
  if (bad >= 0xf0) {
    p.cfg_valid = false;
    p.diverge = 0;
    switch (bad & 15) {
      case 0: c.size = 8; break;
      case 1: c.magic ^= 1; break;
      case 2: c.version = 0; break;
      case 3: c.message_size = 0; break;
      case 4: c.layout = 2; break;
      case 5: c.plan_order = -1; break;
      case 6: c.gradient_predivide_factor = 0.0; break;
      case 7: c.gradient_predivide_factor = NAN; break;
      case 8: c.gradient_predivide_factor = -2.0; break;
      case 9: c.num_streams = 0; break;
      case 10: c.num_streams = 65; break;
      case 11: c.timeout_ms = -1; break;
      case 12: c.unused_policy = 2; break;
      case 13: c.gradient_predivide_factor = INFINITY; break;
      case 14: c.stall_warning_ms = -1; break;
      case 15:
        if (c.layout == DDP_LAYOUT_ARENA && c.plan_order == DDP_PLAN_REGISTRATION) {
          p.cfg_valid = true;
          c.num_streams = 64;
          p.stream_comms = false;
        } else {
          c.shard = 1;  // refused: sharding needs the arena layout and the registration plan
        }
        break;
    }
  }
  if (p.diverge == 3 && p.diverge_grad < 0) p.diverge = 0;
  // Ranks that make different numbers of communicators break the collective contract before libddp
  // is involved; that is not what the divergence is about.
  if (p.diverge == 2 && p.stream_comms) p.diverge = 0;
  // Divergent registration only shows if that grad gets registered: the harness makes sure of it
  // by registering the first grads up front.
  while (!in.empty() && p.calls.size() < kMaxCalls) {
    Call k;
    k.op = in.u8() % OP_COUNT;
    k.a = in.u8();
    k.b = in.u8();
    k.c = in.u8();
    k.d = in.u8();
    p.calls.push_back(k);
  }
  if (p.diverge == 3) {
    // Make the divergent grad exist: prepend enough valid registrations.
    std::vector<Call> pre;
    for (int i = 0; i <= p.diverge_grad; ++i)
      pre.push_back(Call{OP_REGISTER, static_cast<uint8_t>(1 + i), 0, DDP_F32, 0});
    p.calls.insert(p.calls.begin(), pre.begin(), pre.end());
  }
  return p;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ddp_set_log_callback(fuzz_log_a, nullptr);  // stall warnings of short stall_warning_ms stay quiet
  if (size < 4) return 0;
  Shared sh(1);
  sh.prog = parse(data, size);
  // An edge-case knob for this input only; set before any thread of this input reads the environment.
  struct KnobScope {
    const char* name;
    KnobScope(const char* n, const char* v) : name(n) {
      if (name) setenv(name, v, 1);
    }
    ~KnobScope() {
      if (name) unsetenv(name);
    }
  } knob(sh.prog.knob, sh.prog.knob_value);
  if (sh.prog.world == 1) {
    Rank r(sh, 0);
    r.run();
    return 0;
  }
  Shared sh2(2);
  sh2.prog = sh.prog;
  if (ddp_local_group_create(2, &sh2.group) != DDP_SUCCESS) finding(0, 0, "ddp_local_group_create failed");
  std::thread t([&] {
    Rank r(sh2, 1);
    r.run();
  });
  {
    Rank r(sh2, 0);
    r.run();
  }
  t.join();
  ddp_local_group_destroy(sh2.group);
  return 0;
}
