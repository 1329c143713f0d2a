// Multi-rank tests under mpirun: every config combination of the apex options, random grads (sizes,
// dtypes, triggers), a different arrival order on every rank in every iteration, a no_sync iteration,
// moved grad pointers, reduce_all, unused grads, mismatched registrations and configs, broadcast.
// Every reduced value is checked against a float64 reference computed locally from every rank's
// deterministic inputs. Rank 0 prints "mpi(np=N): P passed, F failed".
//
// Built with DDP_TEST_NCCL=1 (the gpusim suite), the same cases run over ddp_comm_init_nccl_mpi with
// every grad in CUDA device memory, written and read back with cudaMemcpy on the legacy stream (the
// user stream the calls are given): "mpi-nccl(np=N): ...". The host-buffer misuse cases (unused-grad
// error policy, broadcast) run only on MPI; the GPU suite covers those on NCCL.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ddp.h"
#include "../support/mpi_harness.hpp"
#include "../support/reference.hpp"

namespace {

struct Case {
  int layout, plan, streams, delay, average, fp32;
  double predivide;
  bool triggers;
  size_t inplace;
  bool unused_zero;
  size_t piece;      // host_piece_bytes (0: the library's choice)
  bool big = false;  // grads of up to 400k elements: pieces large enough for the host ring
  std::string name() const {
    char b[256];
    std::snprintf(b, sizeof b,
                  "layout=%s plan=%s streams=%d delay=%d avg=%d fp32=%d pre=%g trig=%d inplace=%zu zero=%d "
                  "piece=%zu%s",
                  layout ? "arena" : "copy", plan ? "reg" : "learned", streams, delay, average, fp32, predivide,
                  triggers ? 1 : 0, inplace, unused_zero ? 1 : 0, piece, big ? " big" : "");
    return b;
  }
};

struct Grad {
  size_t numel;
  ddp_dtype_t dtype;
  unsigned flags;
  int index;
  void* buf[2] = {nullptr, nullptr};  // copy layout: the two places the grad lives in turn
  size_t bytes() const { return numel * ref::dsize(dtype); }
  Grad() = default;
  Grad(const Grad&) = delete;
  Grad& operator=(const Grad&) = delete;
  ~Grad() {
    grad_free(buf[0]);
    grad_free(buf[1]);
  }
};

void fill(Grad& g, void* p, uint64_t seed, int it, int gi) {
  std::vector<char> host(g.bytes());
  for (size_t i = 0; i < g.numel; ++i)
    ref::store(host.data(), i, g.dtype, ref::quantize(ref::raw_value(seed, g_rank, it, gi, i), g.dtype));
  grad_write(p, host);
}

// Checks grad gi after reduction in iteration `it`; `skipped[r]` says rank r gave zeros.
bool verify(const Grad& g, const void* where, uint64_t seed, int it, int gi, double scale,
            const std::vector<char>& skipped, bool native16, std::string* why) {
  const std::vector<char> host = grad_read(where, g.bytes());
  const void* p = host.data();
  for (size_t i = 0; i < g.numel; ++i) {
    double sum = 0, mag = 0;
    for (int r = 0; r < g_world; ++r) {
      if (skipped[static_cast<size_t>(r)]) continue;
      double v = ref::quantize(ref::raw_value(seed, r, it, gi, i), g.dtype);
      sum += v;
      mag += std::fabs(v);
    }
    double want = sum * scale, got = ref::load(p, i, g.dtype);
    const bool ok = native16 && (g.dtype == DDP_F16 || g.dtype == DDP_BF16)
                        ? ref::close_native16(got, want, mag * std::fabs(scale), g.dtype)
                        : ref::close(got, want, mag * std::fabs(scale), g.dtype);
    if (!ok) {
      char b[256];
      std::snprintf(b, sizeof b, "iteration %d grad %d (%s[%zu]) element %zu: got %.9g want %.9g", it, gi,
                    g.dtype == DDP_F16    ? "f16"
                    : g.dtype == DDP_BF16 ? "bf16"
                    : g.dtype == DDP_F32  ? "f32"
                                          : "f64",
                    g.numel, i, got, want);
      *why = b;
      return false;
    }
  }
  return true;
}

bool run_case(const Case& c, uint64_t seed, std::string* why) {
  std::mt19937_64 shared(seed);                                         // the same on every rank: registration
  std::mt19937_64 mine(seed * 31 + static_cast<uint64_t>(g_rank) + 1);  // this rank's arrival orders
  const int ngrads = 1 + static_cast<int>(shared() % (c.big ? 10 : 24));
  std::vector<Grad> grads(static_cast<size_t>(ngrads));
  for (Grad& g : grads) {
    const bool large = shared() % (c.big ? 2 : 4) == 0;
    g.numel = 1 + shared() % (large ? (c.big ? 400000 : 20000) : 700);
    g.dtype = static_cast<ddp_dtype_t>(shared() % 4);
    g.flags = (c.triggers && shared() % 3 == 0) ? DDP_GRAD_TRIGGER : 0u;
  }
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.message_size = 1 + shared() % (c.big ? 600000 : 20000);
  cfg.layout = c.layout;
  cfg.plan_order = c.plan;
  cfg.num_streams = c.streams;
  cfg.delay_allreduce = c.delay;
  cfg.gradient_average = c.average;
  cfg.allreduce_always_fp32 = c.fp32;
  cfg.gradient_predivide_factor = c.predivide;
  cfg.inplace_min_numel = c.inplace;
  cfg.host_piece_bytes = c.piece;
  cfg.unused_policy = c.unused_zero ? DDP_UNUSED_ZERO : DDP_UNUSED_ERROR;
  cfg.timeout_ms = 60000;
  ddp_t d = nullptr;
  EXPECT_OK(ddp_create(g_comm, &cfg, &d));
  const Closer closer{d};
  for (Grad& g : grads) {
    if (!c.layout) {
      g.buf[0] = grad_alloc(g.bytes());
      g.buf[1] = grad_alloc(g.bytes());
    }
    EXPECT_OK(ddp_register_grad(d, c.layout ? nullptr : g.buf[0], g.numel, g.dtype, g.flags, &g.index));
  }
  EXPECT_OK(ddp_commit(d));
  const double scale = c.average ? 1.0 / g_world : 1.0 / c.predivide;
  const bool native16 = DDP_TEST_NCCL && !c.fp32;  // NCCL sums 16-bit buckets in 16 bits
  auto where = [&](Grad& g, int which) -> void* {
    if (!c.layout) return g.buf[which];
    void* p = nullptr;
    ddp_grad_ptr(d, g.index, &p);
    return p;
  };
  std::vector<char> nobody(static_cast<size_t>(g_world), 0);
  std::vector<int> order(static_cast<size_t>(ngrads));
  for (int i = 0; i < ngrads; ++i) order[static_cast<size_t>(i)] = i;
  int which = 0;  // copy layout: which buffer the grads live in

  for (int it = 0; it < 5; ++it) {
    const bool nosync = it == 1, moved = it == 3 && !c.layout, reduce_all = it == 4;
    // Iteration 2 of the zero policy: each rank leaves out one grad of its own choosing.
    const bool leave_out = it == 2 && c.unused_zero;
    if (moved) which = 1;
    for (int gi = 0; gi < ngrads; ++gi)
      fill(grads[static_cast<size_t>(gi)], where(grads[static_cast<size_t>(gi)], which), seed, it, gi);
    std::vector<std::vector<char>> before;
    if (nosync) {
      EXPECT_OK(ddp_set_sync(d, 0));
      for (Grad& g : grads) before.push_back(grad_read(where(g, which), g.bytes()));
    }
    if (reduce_all) {
      EXPECT_OK(ddp_reduce_all(d, nullptr));
    } else {
      std::shuffle(order.begin(), order.end(), mine);
      const int left_out =
          leave_out ? static_cast<int>((seed + static_cast<uint64_t>(g_rank)) % static_cast<uint64_t>(ngrads)) : -1;
      EXPECT_OK(ddp_begin_backward(d, nullptr));
      for (int gi : order) {
        if (gi == left_out) continue;
        Grad& g = grads[static_cast<size_t>(gi)];
        if (moved)
          EXPECT_OK(ddp_grad_ready_ptr(d, g.index, g.buf[1]));
        else
          EXPECT_OK(ddp_grad_ready(d, g.index));
      }
      EXPECT_OK(ddp_finish_backward(d, nullptr));
      if (leave_out) {
        // Every rank knows which grad each rank left out: rank r skipped (seed + r) % ngrads.
        for (int gi = 0; gi < ngrads; ++gi) {
          std::vector<char> skipped(static_cast<size_t>(g_world), 0);
          for (int r = 0; r < g_world; ++r)
            skipped[static_cast<size_t>(r)] =
                static_cast<int>((seed + static_cast<uint64_t>(r)) % static_cast<uint64_t>(ngrads)) == gi;
          Grad& g = grads[static_cast<size_t>(gi)];
          if (!verify(g, where(g, which), seed, it, gi, scale, skipped, native16, why)) return false;
        }
        continue;
      }
    }
    if (nosync) {
      EXPECT_OK(ddp_set_sync(d, 1));
      for (size_t gi = 0; gi < grads.size(); ++gi) {
        Grad& g = grads[gi];
        if (grad_read(where(g, which), g.bytes()) != before[gi]) {
          *why = "a no_sync iteration changed grad " + std::to_string(gi);
          return false;
        }
      }
      continue;
    }
    for (int gi = 0; gi < ngrads; ++gi) {
      Grad& g = grads[static_cast<size_t>(gi)];
      if (!verify(g, where(g, which), seed, it, gi, scale, nobody, native16, why)) return false;
    }
    // Every rank holds bitwise the same reduced grads (or the replicas would drift apart).
    uint64_t h = 0;
    for (Grad& g : grads)
      for (char byte : grad_read(where(g, which), g.bytes()))
        h = (h ^ static_cast<unsigned char>(byte)) * 1099511628211ull;
    std::vector<uint64_t> hs(static_cast<size_t>(g_world));
    MPI_Allgather(&h, 1, MPI_UINT64_T, hs.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
    for (int r = 0; r < g_world; ++r)
      if (hs[static_cast<size_t>(r)] != hs[0]) {
        *why = "iteration " + std::to_string(it) + ": rank " + std::to_string(r) +
               "'s reduced grads differ in their bits from rank 0's";
        return false;
      }
  }

  // Every rank holds the same plan.
  int nb = 0, learned = 0;
  EXPECT_OK(ddp_get_plan(d, &nb, &learned));
  uint64_t h = static_cast<uint64_t>(nb) * 1315423911u + static_cast<uint64_t>(learned);
  std::vector<int> members(static_cast<size_t>(ngrads));
  for (int b = 0; b < nb; ++b) {
    ddp_bucket_info_t info;
    info.size = sizeof info;
    EXPECT_OK(ddp_get_bucket(d, b, &info, members.data(), members.size()));
    for (int k = 0; k < info.num_grads; ++k) h = ref::mix(h ^ static_cast<uint64_t>(members[static_cast<size_t>(k)]));
    h = ref::mix(h ^ info.numel ^ (static_cast<uint64_t>(info.stream) << 40));
  }
  if (learned != (c.plan == DDP_PLAN_LEARNED)) {
    *why = "plan learned flag is wrong";
    return false;
  }
  std::vector<uint64_t> all(static_cast<size_t>(g_world));
  MPI_Allgather(&h, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  for (uint64_t x : all)
    if (x != all[0]) {
      *why = "ranks hold different plans";
      return false;
    }
  ddp_stats_t st;
  st.size = sizeof st;
  EXPECT_OK(ddp_get_stats(d, &st));
  if (st.iterations != 4 || st.world_size != g_world || st.rank != g_rank) {
    *why = "stats: iterations " + std::to_string(st.iterations);
    return false;
  }
  return true;
}

void test_all_combinations(uint64_t base_seed) {
  int n = 0;
  for (int layout = 0; layout < 2; ++layout)
    for (int plan = 0; plan < 2; ++plan)
      for (int streams : {1, 3})
        for (int delay = 0; delay < 2; ++delay)
          for (double pre : {1.0, 3.0})
            for (int average = 0; average < 2; ++average)
              for (int fp32 = 0; fp32 < 2; ++fp32) {
                ++n;
                Case c{layout, plan, streams, delay, average, fp32, pre, (n % 5) == 0,
                       (!layout && n % 3 == 0) ? size_t(1000)
                       : n % 7 == 2            ? SIZE_MAX
                                               : size_t(0),
                       (n % 4) == 1,
                       // Small pieces, some not a multiple of any element size: many per bucket.
                       n % 3 == 1 ? size_t(4096 + 12 * (n % 5) + (n % 2) * 3) : size_t(0)};
                std::string why;
                if (std::getenv("DDP_TEST_VERBOSE") && g_rank == 0)
                  std::fprintf(stderr, "case %d: %s\n", n, c.name().c_str());
                bool ok = run_case(c, base_seed + static_cast<uint64_t>(n) * 7777, &why);
                record("reduce " + c.name(), ok, why);
              }
}

// Large grads, so that pieces reach the host ring (from 64 KiB): both layouts, in place or packed,
// averaged, pre-divided or summed, pieces not a multiple of the world size.
void test_large(uint64_t base_seed) {
  int n = 0;
  for (int layout = 0; layout < 2; ++layout)
    for (int average = 0; average < 2; ++average)
      for (double pre : {1.0, 3.0})
        for (size_t piece : {size_t(0), size_t(300007)}) {
          ++n;
          Case c{layout, n % 2,   1 + 2 * (n % 2),
                 0,      average, n % 3 == 0,
                 pre,    false,   (!layout && n % 3 == 1) ? SIZE_MAX : size_t(0),
                 false,  piece};
          c.big = true;
          std::string why;
          bool ok = run_case(c, base_seed + 991 + static_cast<uint64_t>(n) * 131, &why);
          record("reduce " + c.name(), ok, why);
        }
}

// --- misuse that needs several ranks -----------------------------------------------------------

void test_mismatch() {
  const int last = g_world - 1;
  struct Variant {
    const char* name;
    int extra_grad, other_dtype, other_msg, other_streams;
    const char* needle;
  };
  const Variant vs[] = {
      {"extra grad", 1, 0, 0, 0, g_world > 1 ? "registered 4 grads but rank 0 registered 3" : nullptr},
      {"other dtype", 0, 1, 0, 0, g_world > 1 ? "grad 2 is f32[50]" : nullptr},
      {"other message_size", 0, 0, 1, 0, g_world > 1 ? "message_size" : nullptr},
      {"other num_streams", 0, 0, 0, 1, g_world > 1 ? "num_streams" : nullptr}};
  for (const Variant& v : vs) {
    std::string why;
    bool ok = true;
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.timeout_ms = 20000;
    bool odd = g_rank == last && g_world > 1;
    if (odd && v.other_msg) cfg.message_size = 12345;
    if (odd && v.other_streams) cfg.num_streams = 2;
    ddp_t d = nullptr;
    ddp_status_t created = ddp_create(g_comm, &cfg, &d);
    if (v.other_msg || v.other_streams) {
      // Config disagreement is found by ddp_create itself, before any other collective.
      ok = expect_status(created, g_world > 1 ? DDP_ERR_MISMATCH : DDP_SUCCESS, v.needle, &why);
      ddp_destroy(d);
      record(std::string("mismatch: ") + v.name, ok, why);
      continue;
    }
    ok = created == DDP_SUCCESS;
    std::vector<float> a(100), b(70), c(50), e(9);
    std::vector<uint16_t> h(50);
    int idx;
    ok = ok && ddp_register_grad(d, a.data(), a.size(), DDP_F32, 0, &idx) == DDP_SUCCESS;
    ok = ok && ddp_register_grad(d, b.data(), b.size(), DDP_F32, 0, &idx) == DDP_SUCCESS;
    if (odd && v.other_dtype)
      ok = ok && ddp_register_grad(d, h.data(), h.size(), DDP_F16, 0, &idx) == DDP_SUCCESS;
    else
      ok = ok && ddp_register_grad(d, c.data(), c.size(), DDP_F32, 0, &idx) == DDP_SUCCESS;
    if (odd && v.extra_grad) ok = ok && ddp_register_grad(d, e.data(), e.size(), DDP_F32, 0, &idx) == DDP_SUCCESS;
    if (!ok) why = "setup failed";
    ddp_status_t st = ddp_begin_backward(d, nullptr);
    if (ok) {
      if (g_world == 1)
        ok = expect_status(st, DDP_SUCCESS, nullptr, &why);
      else
        ok = expect_status(st, DDP_ERR_MISMATCH, v.needle, &why) &&
             expect_status(ddp_begin_backward(d, nullptr), DDP_ERR_ABORTED, "ranks", &why);
    }
    ddp_destroy(d);
    record(std::string("mismatch: ") + v.name, ok, why);
  }
}

void test_unused_error_policy() {
  std::string why;
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.message_size = 64;
  ddp_t d = nullptr;
  bool ok = ddp_create(g_comm, &cfg, &d) == DDP_SUCCESS;
  const int n = 5;
  std::vector<std::vector<float>> bufs(n, std::vector<float>(40, 1.0f));
  int idx[n];
  for (int i = 0; i < n && ok; ++i) ok = ddp_register_grad(d, bufs[i].data(), 40, DDP_F32, 0, &idx[i]) == DDP_SUCCESS;
  // Rank r leaves out grad r % n; every rank must hear of every rank's omission.
  for (int it = 0; it < 2 && ok; ++it) {
    for (auto& b : bufs) std::fill(b.begin(), b.end(), 1.0f);
    ok = ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
    for (int i = 0; i < n && ok; ++i)
      if (it == 1 || i != g_rank % n) ok = ddp_grad_ready(d, idx[i]) == DDP_SUCCESS;
    ddp_status_t st = ddp_finish_backward(d, nullptr);
    if (!ok) break;
    if (it == 0) {
      char needle[64];
      std::snprintf(needle, sizeof needle, "rank %d: grad %d", g_world - 1, (g_world - 1) % n);
      ok = expect_status(st, DDP_ERR_INVALID_STATE, needle, &why);
    } else {
      ok = expect_status(st, DDP_SUCCESS, nullptr, &why);  // the context stays usable
      for (int i = 0; i < n && ok; ++i)
        if (bufs[static_cast<size_t>(i)][0] != 1.0f) {
          ok = false;
          why = "wrong value after the recovered iteration";
        }
    }
  }
  ddp_destroy(d);
  record("unused grads, error policy: named on every rank", ok, why);
}

void test_broadcast() {
  std::string why;
  ddp_t d = nullptr;
  bool ok = ddp_create(g_comm, nullptr, &d) == DDP_SUCCESS;
  const int root = g_world - 1;
  std::vector<double> a(1001);
  std::vector<float> b(7);
  std::vector<uint16_t> c(333);
  for (size_t i = 0; i < a.size(); ++i) a[i] = g_rank == root ? 0.5 * static_cast<double>(i) : -1;
  for (size_t i = 0; i < b.size(); ++i) b[i] = g_rank == root ? static_cast<float>(i) : -1;
  for (size_t i = 0; i < c.size(); ++i) c[i] = g_rank == root ? static_cast<uint16_t>(i) : 0;
  void* bufs[3] = {a.data(), b.data(), c.data()};
  size_t counts[3] = {a.size(), b.size(), c.size()};
  ddp_dtype_t types[3] = {DDP_F64, DDP_F32, DDP_BF16};
  if (ok) ok = expect_status(ddp_broadcast(d, bufs, counts, types, 3, root, nullptr), DDP_SUCCESS, nullptr, &why);
  for (size_t i = 0; ok && i < a.size(); ++i) ok = a[i] == 0.5 * static_cast<double>(i);
  for (size_t i = 0; ok && i < b.size(); ++i) ok = b[i] == static_cast<float>(i);
  for (size_t i = 0; ok && i < c.size(); ++i) ok = c[i] == i;
  if (!ok && why.empty()) why = "wrong broadcast values";
  if (ok)
    ok = expect_status(ddp_broadcast(d, bufs, counts, types, 3, g_world, nullptr), DDP_ERR_INVALID_ARGUMENT, "root",
                       &why);
  ddp_destroy(d);
  record("broadcast from the last rank", ok, why);
}

// DDP_HOST_PIECE_BYTES sizes every host collective's pieces (and a sharded reduce-scatter's, whatever
// config.host_piece_bytes says): ranks that read different values would post collectives of different
// sizes (an MPI ring once wrote 80 KiB into a 32 KiB buffer). ddp_create refuses it on every rank,
// naming the knob, with or without config.host_piece_bytes; the same value everywhere reduces right.
bool one_iteration_with_piece_knob(size_t config_piece, bool expect_refusal, std::string* why) {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.timeout_ms = 5000;
  cfg.host_piece_bytes = config_piece;
  ddp_t d = nullptr;
  const ddp_status_t created = ddp_create(g_comm, &cfg, &d);
  if (expect_refusal) {
    char needle[128];
    std::snprintf(needle, sizeof needle, "DDP_HOST_PIECE_BYTES is 32768 on rank 0 but 81920 on rank %d", g_world - 1);
    const bool ok = expect_status(created, DDP_ERR_MISMATCH, needle, why);
    ddp_destroy(d);
    return ok;
  }
  std::vector<float> g(100000);
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>((g_rank + 1) * 4 + static_cast<int>(i % 7));
  int idx = -1;
  bool ok = expect_status(created, DDP_SUCCESS, nullptr, why) &&
            expect_status(ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &idx), DDP_SUCCESS, nullptr, why) &&
            expect_status(ddp_begin_backward(d, nullptr), DDP_SUCCESS, nullptr, why) &&
            expect_status(ddp_grad_ready(d, idx), DDP_SUCCESS, nullptr, why) &&
            expect_status(ddp_finish_backward(d, nullptr), DDP_SUCCESS, nullptr, why);
  const double mean_rank1 = (g_world + 1) / 2.0;  // the average of (rank + 1) over the ranks
  for (size_t i = 0; ok && i < g.size(); ++i)
    ok = std::fabs(g[i] - (mean_rank1 * 4 + static_cast<double>(i % 7))) < 1e-4;
  if (!ok && why->empty()) *why = "wrong reduced values";
  ddp_destroy(d);
  return ok;
}

void test_wire_knobs() {
  const char* before = std::getenv("DDP_HOST_PIECE_BYTES");
  const std::string saved = before ? before : "";
  for (size_t config_piece : {size_t(0), size_t(65536)}) {
    std::string why;
    setenv("DDP_HOST_PIECE_BYTES", g_rank == g_world - 1 && g_world > 1 ? "81920" : "32768", 1);
    bool ok = one_iteration_with_piece_knob(config_piece, g_world > 1, &why);
    setenv("DDP_HOST_PIECE_BYTES", "32768", 1);
    ok = ok && one_iteration_with_piece_knob(config_piece, false, &why);
    record("DDP_HOST_PIECE_BYTES differing across ranks refused by ddp_create (config.host_piece_bytes " +
               std::to_string(config_piece) + ")",
           ok, why);
  }
  if (before)
    setenv("DDP_HOST_PIECE_BYTES", saved.c_str(), 1);
  else
    unsetenv("DDP_HOST_PIECE_BYTES");
  // The int8 wire's choice of collectives: ranks that read different thresholds would post an
  // all-gather against an all-to-all. Refused on every rank, naming the variable.
  if (g_world > 1) {
    std::string why;
    setenv("DDP_INT8_SCATTER_MIN_WORLD", g_rank == g_world - 1 ? "2" : "3", 1);
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.compression = DDP_COMPRESS_INT8;
    ddp_t d = nullptr;
    char needle[128];
    std::snprintf(needle, sizeof needle, "DDP_INT8_SCATTER_MIN_WORLD is 3 on rank 0 but 2 on rank %d", g_world - 1);
    const bool ok = expect_status(ddp_create(g_comm, &cfg, &d), DDP_ERR_MISMATCH, needle, &why);
    ddp_destroy(d);
    unsetenv("DDP_INT8_SCATTER_MIN_WORLD");
    record("DDP_INT8_SCATTER_MIN_WORLD differing across ranks refused by ddp_create", ok, why);
  }
}

// The last rank starts its backward pass a whole timeout late. Every other rank's DDP_ERR_TIMEOUT
// names it as behind and says where each rank is: on NCCL through the MPI communicator that
// ddp_comm_init_nccl_mpi keeps, on Gloo through its own inspector's sockets. Run last: the late rank's collective is
// left to match the others'.
void test_stall_inspection() {
  if (g_world == 1) return;
  const int64_t timeout_ms = 1500;
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.timeout_ms = timeout_ms;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  ddp_t d = nullptr;
  std::string why;
  bool ok = ddp_create(g_comm, &cfg, &d) == DDP_SUCCESS;
  void* grad = grad_alloc(4000);
  int idx = -1;
  ok = ok && ddp_register_grad(d, grad, 1000, DDP_F32, 0, &idx) == DDP_SUCCESS;
  for (int it = 0; it < 2 && ok; ++it) {
    if (it == 1) {
      MPI_Barrier(MPI_COMM_WORLD);
      if (g_rank == g_world - 1) usleep(static_cast<useconds_t>((timeout_ms + 1500) * 1000));
    }
    ddp_status_t st = ddp_begin_backward(d, nullptr);
    if (!st) st = ddp_grad_ready(d, idx);
    if (!st) st = ddp_finish_backward(d, nullptr);
    if (!st) st = ddp_synchronize(d);
    if (it == 0) {
      ok = expect_status(st, DDP_SUCCESS, nullptr, &why);
    } else if (g_rank != g_world - 1) {
      char needle[64];
      std::snprintf(needle, sizeof needle, "behind this rank: rank %d", g_world - 1);
      ok = expect_status(st, DDP_ERR_TIMEOUT, needle, &why) &&
           expect_status(st, DDP_ERR_TIMEOUT, "(this rank): iteration 1", &why);
    }
  }
  if (!ok && why.empty()) why = "setup failed";
  if (g_rank != g_world - 1) usleep(static_cast<useconds_t>(timeout_ms * 1000));  // the late rank may ask too
  ddp_destroy(d);
  grad_free(grad);
  record("a late rank is named by the others' timeout, with every rank's position", ok, why);
}

}  // namespace

int main(int argc, char** argv) {
  const char* label = start(&argc, &argv, "mpi", "mpi-nccl");
  const uint64_t seed = shared_seed(argc, argv, 20261202);
  test_all_combinations(seed);
  test_large(seed);
  test_mismatch();
  if (!DDP_TEST_NCCL) test_wire_knobs();
  if (!DDP_TEST_NCCL) {
    test_unused_error_policy();
    test_broadcast();
  }
  if (DDP_TEST_NCCL || g_gloo) test_stall_inspection();
  return finish(label, seed);
}
