// The int8 wire's error bound, checked literally: every reduced value against the formula of
// include/ddp.h (DDP_COMPRESS_INT8), computed by tests/support/int8_bound.hpp from the inputs alone,
// over in-process ranks (a local group) at 1 to 4 ranks, the all-gather (whole and in rounds) and the
// reduce-scatter, both layouts, with and without pre-division and averaging, over iterations whose
// magnitudes jump by up to 2^16 (so that the kept errors of the last reduction weigh in).
#include <doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "../support/int8_bound.hpp"
#include "../support/int8_model.hpp"
#include "../support/reference.hpp"
#include "ddp.h"
#include "local_ranks.hpp"

namespace {

struct BoundRun {
  std::vector<size_t> numel;
  std::vector<ddp_dtype_t> dtype;
  std::vector<double> mag;
  int arena = 0, iters = 6, average = 0, min_world = 1 << 30;
  double predivide = 1.0;
  size_t piece_bytes = 0;
  uint64_t seed = 0;
};

// Rank r's grad g, element i, in iteration it: a per-(rank, iteration, grad) magnitude from 2^-12
// to 2^4 times the grad's own, so that one reduction's kept errors may dwarf the next one's values.
double grad_value(const BoundRun& m, int r, int it, size_t g, size_t i) {
  const uint64_t k = ref::mix(m.seed ^ (static_cast<uint64_t>(r) << 40) ^ (static_cast<uint64_t>(it) << 20) ^ g);
  const double jump = std::ldexp(1.0, static_cast<int>(k % 17) - 12);
  return ref::quantize(ref::raw_value(m.seed, r, it, static_cast<int>(g), i) * m.mag[g] * jump, m.dtype[g]);
}

struct Worst {
  double ratio = 0;  // the largest |error| / bound seen
};

// One rank: every element of every iteration against the header's bound. *worst: the tightest spot.
bool bound_rank(int r, int world, ddp_comm_t c, const BoundRun& m, Worst* worst) {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.layout = m.arena;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.message_size = 1 << 20;
  cfg.compression = DDP_COMPRESS_INT8;
  cfg.gradient_average = m.average;
  cfg.gradient_predivide_factor = m.predivide;
  cfg.host_piece_bytes = m.piece_bytes;
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  if (ddp_create(c, &cfg, &d) != DDP_SUCCESS) return false;
  const size_t ng = m.numel.size();
  std::vector<std::vector<char>> mem(ng);
  std::vector<int> index(ng);
  bool ok = true;
  for (size_t g = 0; g < ng && ok; ++g) {
    mem[g].assign(m.numel[g] * ref::dsize(m.dtype[g]), 0);
    ok = ddp_register_grad(d, m.arena ? nullptr : mem[g].data(), m.numel[g], m.dtype[g], 0, &index[g]) == DDP_SUCCESS;
  }
  ok = ok && ddp_commit(d) == DDP_SUCCESS;
  int nb = 0;
  ok = ok && ddp_get_plan(d, &nb, nullptr) == DDP_SUCCESS;
  std::vector<int> bucket_of(ng, -1);
  std::vector<size_t> offset(ng, 0), bucket_n(static_cast<size_t>(std::max(nb, 0)), 0);
  std::vector<bool> f32(bucket_n.size(), true);
  for (int b = 0; b < nb && ok; ++b) {
    ddp_bucket_info_t info;
    info.size = sizeof info;
    std::vector<int> grads(ng);
    ok = ddp_get_bucket(d, b, &info, grads.data(), grads.size()) == DDP_SUCCESS;
    for (int k = 0; ok && k < info.num_grads; ++k) {
      const size_t g = static_cast<size_t>(grads[static_cast<size_t>(k)]);
      bucket_of[g] = b;
      offset[g] = bucket_n[static_cast<size_t>(b)];
      bucket_n[static_cast<size_t>(b)] += m.numel[g];
      f32[static_cast<size_t>(b)] = m.dtype[g] == DDP_F32;
    }
  }
  std::vector<int8_bound::Int8Bound> bounds;
  for (int b = 0; b < nb; ++b) {
    const size_t bn = bucket_n[static_cast<size_t>(b)];
    bounds.emplace_back(bn, world, f32[static_cast<size_t>(b)], int8_model::scatters(bn, world, m.min_world));
  }
  auto ptr = [&](size_t g) -> void* {
    void* p = mem[g].data();
    if (m.arena) ddp_grad_ptr(d, index[g], &p);
    return p;
  };
  const double post = m.average ? m.predivide / world : 1.0;
  std::mt19937_64 order_rng(m.seed * 31 + static_cast<uint64_t>(r));
  for (int it = 0; ok && it < m.iters; ++it) {
    for (size_t g = 0; g < ng; ++g)
      for (size_t i = 0; i < m.numel[g]; ++i) ref::store(ptr(g), i, m.dtype[g], grad_value(m, r, it, g, i));
    std::vector<size_t> order(ng);
    for (size_t g = 0; g < ng; ++g) order[g] = g;
    std::shuffle(order.begin(), order.end(), order_rng);
    ok = ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
    for (size_t g : order) ok = ok && ddp_grad_ready(d, index[g]) == DDP_SUCCESS;
    ok = ok && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
    for (int b = 0; ok && b < nb; ++b) {
      const size_t bn = bucket_n[static_cast<size_t>(b)];
      std::vector<std::vector<double>> xs(static_cast<size_t>(world), std::vector<double>(bn));
      for (size_t g = 0; g < ng; ++g)
        if (bucket_of[g] == b)
          for (int q = 0; q < world; ++q)
            for (size_t i = 0; i < m.numel[g]; ++i)
              xs[static_cast<size_t>(q)][offset[g] + i] = grad_value(m, q, it, g, i) / m.predivide;
      const std::vector<double> bound = bounds[static_cast<size_t>(b)].step(xs);
      const double u = f32[static_cast<size_t>(b)] ? std::ldexp(1.0, -24) : std::ldexp(1.0, -53);
      for (size_t g = 0; ok && g < ng; ++g) {
        if (bucket_of[g] != b) continue;
        for (size_t i = 0; i < m.numel[g]; ++i) {
          double exact = 0;
          for (int q = 0; q < world; ++q) exact += xs[static_cast<size_t>(q)][offset[g] + i];
          const double got = ref::load(ptr(g), i, m.dtype[g]);
          // gradient_average's multiplication by f / W: one more rounding, u of the result.
          const double err = std::fabs(got - post * exact), allowed = post * bound[offset[g] + i] + u * std::fabs(got);
          if (!(err <= allowed)) {
            MESSAGE("rank ", r, " of ", world, " iteration ", it, " grad ", g, "[", i, "] (",
                    f32[static_cast<size_t>(b)] ? "f32" : "f64", "): ", got, ", exact ", post * exact, ", error ", err,
                    " past the header's bound ", allowed);
            ok = false;
            break;
          }
          if (allowed > 0) worst->ratio = std::max(worst->ratio, err / allowed);
        }
      }
    }
  }
  ok = ddp_destroy(d) == DDP_SUCCESS && ok;
  return ok;
}

}  // namespace

TEST_CASE("int8 wire: every reduced value within the header's bound, all-gather and reduce-scatter, 1..4 ranks") {
  // DDP_TEST_SEED repeats another draw.
  std::mt19937_64 rng(getenv("DDP_TEST_SEED") ? std::strtoull(getenv("DDP_TEST_SEED"), nullptr, 10) : 8123);
  double tightest = 0;
  for (int world = 1; world <= 4; ++world)
    for (int path = 0; path < 3; ++path)  // the all-gather whole, in rounds, the reduce-scatter
      for (int arena = 0; arena <= 1; ++arena) {
        BoundRun m;
        m.seed = rng();
        m.arena = arena;
        m.piece_bytes = path == 1 ? 4096 : 0;
        m.min_world = path == 2 ? 1 : 1 << 30;
        m.average = static_cast<int>(rng() % 2);
        const double factors[] = {1.0, 1.0, 3.0, 0.25};
        m.predivide = factors[rng() % 4];
        const int ng = 1 + static_cast<int>(rng() % 4);
        for (int g = 0; g < ng; ++g) {
          m.numel.push_back(1 + rng() % (rng() % 3 ? 1500 : 6000));
          m.dtype.push_back(rng() % 3 ? DDP_F32 : DDP_F64);
          m.mag.push_back(std::ldexp(1.0, static_cast<int>(rng() % 41) - 20));
        }
        setenv("DDP_INT8_SCATTER_MIN_WORLD", std::to_string(m.min_world).c_str(), 1);
        std::vector<Worst> worst(static_cast<size_t>(world));
        const int failed = on_ranks(
            world, [&](int r, ddp_comm_t c) { return bound_rank(r, world, c, m, &worst[static_cast<size_t>(r)]); });
        unsetenv("DDP_INT8_SCATTER_MIN_WORLD");
        CHECK_MESSAGE(failed == 0, "world ", world, " path ", path, " arena ", arena, " average ", m.average,
                      " predivide ", m.predivide);
        for (const Worst& w : worst) tightest = std::max(tightest, w.ratio);
      }
  // The bound is not vacuous: somewhere the error comes within a fifth of it.
  CHECK_MESSAGE(tightest > 0.2, "the largest error / bound seen is ", tightest);
}
