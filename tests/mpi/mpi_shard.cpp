// Multi-rank tests of sharded contexts (config.shard) under mpirun: every option combination that
// sharding allows (streams, delay, averaging, pre-division, fp32 wire, triggers, unused policy),
// random grads, a different arrival order on every rank, no_sync, unused grads, reduce_all. After
// each reduction every element this rank owns (ddp_grad_shard) is checked against the float64
// reference, the padding of its shard is zero, and the ranks' shards cover every grad exactly once;
// then each rank writes its parameter shard, ddp_gather_params gathers them, ddp_wait_params waits
// grad by grad in a random order, and every rank's parameter arena must be bitwise identical and
// hold every rank's writes; ddp_shard_norm must match the norm of what the ranks own, with NaN
// counted once. Rank 0 prints "mpi-shard(np=N): P passed, F failed" ("mpi-nccl-shard" over NCCL).
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "ddp.h"
#include "../support/mpi_harness.hpp"
#include "../support/reference.hpp"

namespace {

struct Case {
  int streams, delay, average, fp32;
  double predivide;
  bool triggers, unused_zero, nan, big;
  std::string name() const {
    char b[200];
    std::snprintf(b, sizeof b, "shard streams=%d delay=%d avg=%d fp32=%d pre=%g trig=%d zero=%d nan=%d%s", streams,
                  delay, average, fp32, predivide, triggers ? 1 : 0, unused_zero ? 1 : 0, nan ? 1 : 0,
                  big ? " big" : "");
    return b;
  }
};

struct G {
  size_t numel;
  ddp_dtype_t dtype;
  unsigned flags;
  int index;
  int bucket = -1;
  size_t offset = 0;  // in its bucket, elements
  size_t bytes() const { return numel * ref::dsize(dtype); }
};

void* grad_at(ddp_t d, const G& g) {
  void* p = nullptr;
  ddp_grad_ptr(d, g.index, &p);
  return p;
}

// The parameter value of element k of bucket b after the update of iteration `it`.
double param_value(int b, size_t k, int it, ddp_dtype_t dt) {
  return ref::quantize(ref::raw_value(4242, 0, it, b, k), dt);
}

// Every owned element against the reference; the shard's padding; the sum of squares of what this
// rank owns (NaN left out, counted in *bad).
bool check_shards(ddp_t d, const std::vector<G>& grads, uint64_t seed, int it, double scale,
                  const std::vector<int>& left_out, bool native16, const G* nan_grad, double* sumsq, double* bad,
                  std::string* why) {
  *sumsq = 0;
  *bad = 0;
  for (size_t gi = 0; gi < grads.size(); ++gi) {
    const G& g = grads[gi];
    size_t first = 0, count = 0, pos = 0;
    EXPECT_OK(ddp_grad_shard(d, g.index, &first, &count, &pos));
    const std::vector<char> host = grad_read(grad_at(d, g), g.bytes());
    for (size_t i = first; i < first + count; ++i) {
      double sum = 0, mag = 0;
      for (int r = 0; r < g_world; ++r) {
        if (left_out[static_cast<size_t>(r)] == static_cast<int>(gi)) continue;
        const double v = ref::quantize(ref::raw_value(seed, r, it, static_cast<int>(gi), i), g.dtype);
        sum += v;
        mag += std::fabs(v);
      }
      const double got = ref::load(host.data(), i, g.dtype), want = sum * scale;
      if (nan_grad == &g && i == 0) {
        if (!std::isnan(got)) {
          *why = "the NaN did not travel";
          return false;
        }
        *bad += 1;
        continue;
      }
      const bool ok = native16 && (g.dtype == DDP_F16 || g.dtype == DDP_BF16)
                          ? ref::close_native16(got, want, mag * std::fabs(scale), g.dtype)
                          : ref::close(got, want, mag * std::fabs(scale), g.dtype);
      if (!ok) {
        char b[200];
        std::snprintf(b, sizeof b, "iteration %d grad %zu [%zu] element %zu (shard position %zu): got %.9g want %.9g",
                      it, gi, g.numel, i, pos + i - first, got, want);
        *why = b;
        return false;
      }
      *sumsq += got * got;
    }
    // The ranks' shards cover every element of the grad once.
    unsigned long long mine = count, all = 0;
    MPI_Allreduce(&mine, &all, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (all != g.numel) {
      *why = "grad " + std::to_string(gi) + ": the shards own " + std::to_string(all) + " of its " +
             std::to_string(g.numel) + " elements";
      return false;
    }
  }
  int nb = 0;
  EXPECT_OK(ddp_get_plan(d, &nb, nullptr));
  for (int b = 0; b < nb; ++b) {
    ddp_shard_info_t s;
    s.size = sizeof s;
    EXPECT_OK(ddp_get_shard(d, b, &s));
    const size_t es = ref::dsize(s.dtype);
    const std::vector<char> host = grad_read(s.grad_shard, s.shard_numel * es);
    for (size_t j = 0; j < s.shard_numel; ++j)
      if (s.shard_offset + j >= s.grads_numel && ref::load(host.data(), j, s.dtype) != 0.0) {
        *why = "bucket " + std::to_string(b) + ": padding element " + std::to_string(s.shard_offset + j) + " is not 0";
        return false;
      }
    if (s.bucket_numel != s.shard_numel * static_cast<size_t>(g_world) || s.shard_offset != s.shard_numel * g_rank ||
        (s.shard_numel * es) % 256 != 0 || s.arena_offset % 256 != 0) {
      *why = "bucket " + std::to_string(b) + ": shard geometry";
      return false;
    }
  }
  return true;
}

// Each rank writes its own parameter shards, gathers, waits grad by grad in its own random order, and
// must see every rank's values; the arenas must match bitwise.
bool check_gather(ddp_t d, const std::vector<G>& grads, int it, std::mt19937_64& mine, std::string* why) {
  int nb = 0;
  EXPECT_OK(ddp_get_plan(d, &nb, nullptr));
  std::vector<ddp_shard_info_t> shards(static_cast<size_t>(nb));
  for (int b = 0; b < nb; ++b) {
    ddp_shard_info_t& s = shards[static_cast<size_t>(b)];
    s.size = sizeof s;
    EXPECT_OK(ddp_get_shard(d, b, &s));
    std::vector<char> host(s.shard_numel * ref::dsize(s.dtype));
    for (size_t j = 0; j < s.shard_numel; ++j) {
      const size_t k = s.shard_offset + j;
      ref::store(host.data(), j, s.dtype, k < s.grads_numel ? param_value(b, k, it, s.dtype) : 0.0);
    }
    grad_write(s.param_shard, host);
  }
  EXPECT_OK(ddp_gather_params(d, nullptr));
  std::vector<size_t> order(grads.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), mine);
  for (size_t gi : order) {
    const G& g = grads[gi];
    EXPECT_OK(ddp_wait_params(d, g.index, nullptr));
    void* p = nullptr;
    EXPECT_OK(ddp_param_ptr(d, g.index, &p));
    const std::vector<char> host = grad_read(p, g.bytes());
    for (size_t i = 0; i < g.numel; ++i)
      if (ref::load(host.data(), i, g.dtype) != param_value(g.bucket, g.offset + i, it, g.dtype)) {
        *why = "iteration " + std::to_string(it) + ": parameter " + std::to_string(gi) + " element " +
               std::to_string(i) + " was not gathered";
        return false;
      }
  }
  EXPECT_OK(ddp_wait_params(d, -1, nullptr));
  uint64_t h = 0;
  for (const ddp_shard_info_t& s : shards) {
    const size_t es = ref::dsize(s.dtype);
    for (char byte : grad_read(static_cast<char*>(s.param_shard) - s.shard_offset * es, s.bucket_numel * es))
      h = (h ^ static_cast<unsigned char>(byte)) * 1099511628211ull;
  }
  std::vector<uint64_t> hs(static_cast<size_t>(g_world));
  MPI_Allgather(&h, 1, MPI_UINT64_T, hs.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  for (uint64_t x : hs)
    if (x != hs[0]) {
      *why = "iteration " + std::to_string(it) + ": the parameter arenas differ between ranks";
      return false;
    }
  return true;
}

bool run_case(const Case& c, uint64_t seed, std::string* why) {
  std::mt19937_64 shared(seed);
  std::mt19937_64 mine(seed * 31 + static_cast<uint64_t>(g_rank) + 1);
  const int ngrads = 1 + static_cast<int>(shared() % (c.big ? 8 : 20));
  std::vector<G> grads(static_cast<size_t>(ngrads));
  for (G& g : grads) {
    const bool large = shared() % (c.big ? 2 : 4) == 0;
    g.numel = 1 + shared() % (large ? (c.big ? 300000 : 20000) : 700);
    g.dtype = static_cast<ddp_dtype_t>(shared() % 4);
    g.flags = (c.triggers && shared() % 3 == 0) ? DDP_GRAD_TRIGGER : 0u;
  }
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.message_size = 1 + shared() % (c.big ? 500000 : 20000);
  cfg.layout = DDP_LAYOUT_ARENA;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.shard = 1;
  cfg.num_streams = c.streams;
  cfg.delay_allreduce = c.delay;
  cfg.gradient_average = c.average;
  cfg.allreduce_always_fp32 = c.fp32;
  cfg.gradient_predivide_factor = c.predivide;
  cfg.unused_policy = c.unused_zero ? DDP_UNUSED_ZERO : DDP_UNUSED_ERROR;
  cfg.timeout_ms = 60000;
  ddp_t d = nullptr;
  EXPECT_OK(ddp_create(g_comm, &cfg, &d));
  const Closer closer{d};
  for (G& g : grads) EXPECT_OK(ddp_register_grad(d, nullptr, g.numel, g.dtype, g.flags, &g.index));
  EXPECT_OK(ddp_commit(d));
  int nb = 0;
  EXPECT_OK(ddp_get_plan(d, &nb, nullptr));
  for (int b = 0; b < nb; ++b) {  // where each grad lies in its bucket
    ddp_shard_info_t s;
    s.size = sizeof s;
    EXPECT_OK(ddp_get_shard(d, b, &s));
    std::vector<int> members(grads.size());
    ddp_bucket_info_t info;
    info.size = sizeof info;
    EXPECT_OK(ddp_get_bucket(d, b, &info, members.data(), members.size()));
    const char* start = static_cast<char*>(s.grad_shard) - s.shard_offset * ref::dsize(s.dtype);
    for (int k = 0; k < info.num_grads; ++k) {
      G& g = grads[static_cast<size_t>(members[static_cast<size_t>(k)])];
      g.bucket = b;
      g.offset = static_cast<size_t>(static_cast<char*>(grad_at(d, g)) - start) / ref::dsize(g.dtype);
    }
  }
  const double scale = c.average ? 1.0 / g_world : 1.0 / c.predivide;
  const bool native16 = DDP_TEST_NCCL && !c.fp32;
  std::vector<int> order(static_cast<size_t>(ngrads));
  for (int i = 0; i < ngrads; ++i) order[static_cast<size_t>(i)] = i;
  for (int it = 0; it < 5; ++it) {
    const bool nosync = it == 1, reduce_all = it == 4, leave_out = it == 2 && c.unused_zero;
    const G* nan_grad = c.nan && it == 3 ? &grads[0] : nullptr;
    for (int gi = 0; gi < ngrads; ++gi) {
      const G& g = grads[static_cast<size_t>(gi)];
      std::vector<char> host(g.bytes());
      for (size_t i = 0; i < g.numel; ++i)
        ref::store(host.data(), i, g.dtype, ref::quantize(ref::raw_value(seed, g_rank, it, gi, i), g.dtype));
      if (nan_grad == &g && g_rank == 0) ref::store(host.data(), 0, g.dtype, NAN);
      grad_write(grad_at(d, g), host);
    }
    std::vector<int> left_out(static_cast<size_t>(g_world), -1);
    if (leave_out)
      for (int r = 0; r < g_world; ++r)
        left_out[static_cast<size_t>(r)] = static_cast<int>((seed + static_cast<uint64_t>(r)) % ngrads);
    std::vector<std::vector<char>> before;
    if (nosync) {
      EXPECT_OK(ddp_set_sync(d, 0));
      for (const G& g : grads) before.push_back(grad_read(grad_at(d, g), g.bytes()));
    }
    if (reduce_all) {
      EXPECT_OK(ddp_reduce_all(d, nullptr));
    } else {
      std::shuffle(order.begin(), order.end(), mine);
      EXPECT_OK(ddp_begin_backward(d, nullptr));
      for (int gi : order)
        if (gi != left_out[static_cast<size_t>(g_rank)])
          EXPECT_OK(ddp_grad_ready(d, grads[static_cast<size_t>(gi)].index));
      EXPECT_OK(ddp_finish_backward(d, nullptr));
    }
    if (nosync) {
      EXPECT_OK(ddp_set_sync(d, 1));
      for (size_t gi = 0; gi < grads.size(); ++gi)
        if (grad_read(grad_at(d, grads[gi]), grads[gi].bytes()) != before[gi]) {
          *why = "a no_sync iteration changed grad " + std::to_string(gi);
          return false;
        }
      // A gather was launched after iteration 0: not again before the next reduction.
      if (!expect_status(ddp_gather_params(d, nullptr), DDP_ERR_INVALID_STATE, "already gathered", why)) return false;
      continue;
    }
    double sq = 0, bad = 0;
    if (!check_shards(d, grads, seed, it, scale, left_out, native16, nan_grad, &sq, &bad, why)) return false;
    double all[2] = {0, 0}, here[2] = {sq, bad};
    MPI_Allreduce(here, all, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    double norm = -1;
    uint64_t nonfinite = 99;
    EXPECT_OK(ddp_shard_norm(d, nullptr, &norm, &nonfinite));
    if (std::fabs(norm - std::sqrt(all[0])) > 1e-9 * std::sqrt(all[0]) + 1e-300 ||
        nonfinite != static_cast<uint64_t>(all[1])) {
      char b[160];
      std::snprintf(b, sizeof b, "iteration %d: ddp_shard_norm %.17g (%llu non-finite), the shards' own %.17g (%g)", it,
                    norm, static_cast<unsigned long long>(nonfinite), std::sqrt(all[0]), all[1]);
      *why = b;
      return false;
    }
    if (nan_grad && nonfinite != 1) {
      *why = "the NaN was not counted once";
      return false;
    }
    if (!check_gather(d, grads, it, mine, why)) return false;
  }
  return true;
}

void test_all_combinations(uint64_t base_seed) {
  int n = 0;
  for (int streams : {1, 3})
    for (int delay = 0; delay < 2; ++delay)
      for (double pre : {1.0, 3.0})
        for (int average = 0; average < 2; ++average)
          for (int fp32 = 0; fp32 < 2; ++fp32) {
            ++n;
            Case c{streams, delay, average, fp32, pre, n % 5 == 0, n % 2 == 1, n % 3 == 0, false};
            std::string why;
            bool ok = run_case(c, base_seed + static_cast<uint64_t>(n) * 7777, &why);
            record(c.name(), ok, why);
          }
  for (int k = 0; k < 4; ++k) {  // grads large enough for the host ring's pieces
    Case c{1 + 2 * (k % 2), 0, k < 2, k % 2, k == 3 ? 3.0 : 1.0, false, k == 1, false, true};
    std::string why;
    bool ok = run_case(c, base_seed + 555 + static_cast<uint64_t>(k), &why);
    record(c.name(), ok, why);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* label = start(&argc, &argv, "mpi-shard", "mpi-nccl-shard");
  const uint64_t seed = shared_seed(argc, argv, 20261203);
  test_all_combinations(seed);
  return finish(label, seed);
}
