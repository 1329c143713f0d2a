// The int8 wire's two collectives over in-process ranks (a local group): the all-gather of every
// rank's chunk (in rounds when the host pieces are smaller than the bucket) and the reduce-scatter (each rank sums and
// re-quantizes one shard), chosen by DDP_INT8_SCATTER_MIN_WORLD, against the float64 model of the same quantization,
// bit for bit, at 1 to 4 ranks; and what each sends.
#include <doctest.h>

#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "../support/int8_model.hpp"
#include "../support/reference.hpp"
#include "ddp.h"
#include "local_ranks.hpp"

namespace {

struct Int8Run {
  std::vector<size_t> numel;
  std::vector<ddp_dtype_t> dtype;
  std::vector<double> mag;
  int arena = 0, iters = 3;
  size_t piece_bytes = 0;  // config.host_piece_bytes: small ones make the all-gather go in rounds
  uint64_t seed = 0;
  struct Plant {
    int rank, it;
    size_t g, i;
    double v;
  };
  std::vector<Plant> plants;  // values put in place of the random ones
  struct Expect {
    int it;
    size_t g, i;
    bool nan;
  };
  std::vector<Expect> expects;  // results that must be NaN (or must not), whatever the model says
};

double input(const Int8Run& m, int rank, int it, size_t g, size_t i) {
  for (const Int8Run::Plant& p : m.plants)
    if (p.rank == rank && p.it == it && p.g == g && p.i == i) return p.v;
  return ref::quantize(ref::raw_value(m.seed, rank, it, static_cast<int>(g), i) * m.mag[g], m.dtype[g]);
}

// Equal bits, or both NaN (a NaN's sign and payload are not promised).
bool same_value(double v, double w) {
  return std::isnan(v) ? std::isnan(w) : v == w && std::signbit(v) == std::signbit(w);
}

// One rank: registers the grads (one bucket per dtype: message_size holds them all), runs the
// iterations and compares every element with the model; *sent: its bytes on the wire.
bool int8_rank(int r, int world, ddp_comm_t c, const Int8Run& m, int min_world, uint64_t* sent) {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.layout = m.arena;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.message_size = 1 << 20;
  cfg.compression = DDP_COMPRESS_INT8;
  cfg.gradient_average = 0;
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
  // The buckets as the plan made them: per grad its bucket and offset.
  int nb = 0;
  ok = ok && ddp_get_plan(d, &nb, nullptr) == DDP_SUCCESS;
  std::vector<int> bucket_of(ng, -1);
  std::vector<size_t> offset(ng, 0), bucket_n(static_cast<size_t>(nb), 0);
  std::vector<bool> f32(static_cast<size_t>(nb), true);
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
  auto ptr = [&](size_t g) -> void* {
    void* p = mem[g].data();
    if (m.arena) ddp_grad_ptr(d, index[g], &p);
    return p;
  };
  const size_t W = static_cast<size_t>(world);
  std::vector<std::vector<std::vector<double>>> res(static_cast<size_t>(nb)), shard(static_cast<size_t>(nb));
  for (int b = 0; b < nb; ++b) {
    res[static_cast<size_t>(b)].assign(W, std::vector<double>(bucket_n[static_cast<size_t>(b)], 0.0));
    shard[static_cast<size_t>(b)].assign(W, std::vector<double>());
  }
  std::mt19937_64 order_rng(m.seed + static_cast<uint64_t>(r));
  for (int it = 0; ok && it < m.iters; ++it) {
    for (size_t g = 0; g < ng; ++g)
      for (size_t i = 0; i < m.numel[g]; ++i) ref::store(ptr(g), i, m.dtype[g], input(m, r, it, g, i));
    std::vector<size_t> order(ng);
    for (size_t g = 0; g < ng; ++g) order[g] = g;
    std::shuffle(order.begin(), order.end(), order_rng);
    ok = ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
    for (size_t g : order) ok = ok && ddp_grad_ready(d, index[g]) == DDP_SUCCESS;
    ok = ok && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
    for (int b = 0; ok && b < nb; ++b) {
      const size_t bn = bucket_n[static_cast<size_t>(b)];
      std::vector<std::vector<double>> xs(W, std::vector<double>(bn));
      for (size_t g = 0; g < ng; ++g)
        if (bucket_of[g] == b)
          for (int q = 0; q < world; ++q)
            for (size_t i = 0; i < m.numel[g]; ++i) xs[static_cast<size_t>(q)][offset[g] + i] = input(m, q, it, g, i);
      const bool scatter = int8_model::scatters(bn, world, min_world);
      const std::vector<double> want = int8_model::model_int8(
          xs, res[static_cast<size_t>(b)], shard[static_cast<size_t>(b)], scatter, f32[static_cast<size_t>(b)]);
      for (size_t g = 0; ok && g < ng; ++g) {
        if (bucket_of[g] != b) continue;
        for (size_t i = 0; i < m.numel[g]; ++i) {
          const double v = ref::load(ptr(g), i, m.dtype[g]), w = want[offset[g] + i];
          if (!same_value(v, w)) {
            if (r == 0)
              MESSAGE("world ", world, std::string(scatter ? " reduce-scatter" : " all-gather"), " iteration ", it,
                      " grad ", g, "[", i, "]: ", v, ", the model ", w);
            ok = false;
            break;
          }
        }
      }
    }
    for (const Int8Run::Expect& e : m.expects) {
      if (!ok || e.it != it) continue;
      const double v = ref::load(ptr(e.g), e.i, m.dtype[e.g]);
      if (std::isnan(v) != e.nan) {
        MESSAGE("rank ", r, " of ", world, " iteration ", it, " grad ", e.g, "[", e.i, "]: ", v, ", want ",
                e.nan ? "NaN" : "a finite value");
        ok = false;
      }
    }
  }
  ddp_stats_t st;
  st.size = sizeof st;
  ok = ok && ddp_get_stats(d, &st) == DDP_SUCCESS;
  *sent = st.bytes_sent;
  ok = ddp_destroy(d) == DDP_SUCCESS && ok;
  return ok;
}

// Every rank of a local group of `world` through the collective that DDP_INT8_SCATTER_MIN_WORLD =
// `min_world` chooses; rank 0's bytes sent.
uint64_t run_group(int world, const Int8Run& m, int min_world) {
  setenv("DDP_INT8_SCATTER_MIN_WORLD", std::to_string(min_world).c_str(), 1);
  std::vector<uint64_t> sent(static_cast<size_t>(world), 0);
  const int failed = on_ranks(
      world, [&](int r, ddp_comm_t c) { return int8_rank(r, world, c, m, min_world, &sent[static_cast<size_t>(r)]); });
  unsetenv("DDP_INT8_SCATTER_MIN_WORLD");
  CHECK_MESSAGE(failed == 0, "world ", world, " DDP_INT8_SCATTER_MIN_WORLD ", min_world, " arena ", m.arena);
  return sent[0];
}

}  // namespace

TEST_CASE("int8 wire: all-gather and reduce-scatter equal the float64 model bit for bit at 1..4 ranks") {
  std::mt19937_64 rng(2026);
  for (int world = 1; world <= 4; ++world)
    for (int t = 0; t < 3; ++t) {
      Int8Run m;
      m.seed = rng();
      m.arena = static_cast<int>(rng() % 2);
      const int ng = 1 + static_cast<int>(rng() % 4);
      for (int g = 0; g < ng; ++g) {
        // Sizes below one block per rank too: some ranks then own an empty shard.
        m.numel.push_back(1 + rng() % (rng() % 3 ? 700 : 5000));
        m.dtype.push_back(rng() % 3 ? DDP_F32 : DDP_F64);
        m.mag.push_back(std::ldexp(1.0, static_cast<int>(rng() % 17) - 8));
      }
      // The all-gather whole and in rounds of 4 blocks (host pieces of 4096 bytes).
      m.piece_bytes = 4096;
      run_group(world, m, 1 << 30);
      m.piece_bytes = 0;
      const uint64_t gather = run_group(world, m, 1 << 30);
      const uint64_t scatter = run_group(world, m, 1);
      if (world == 1) {
        CHECK(gather == 0);
        CHECK(scatter == 0);
      }
      // (world - 1) chunks against 2 (world - 1) shard chunks: the same at world 2; from 3 on never
      // more, and fewer where some bucket (one per dtype here) is large enough to gain.
      size_t f32 = 0, f64 = 0;
      for (size_t g = 0; g < m.numel.size(); ++g) (m.dtype[g] == DDP_F32 ? f32 : f64) += m.numel[g];
      if (world >= 3) {
        CHECK(scatter <= gather);
        if ((f32 && int8_model::scatters(f32, world, 1)) || (f64 && int8_model::scatters(f64, world, 1)))
          CHECK(scatter < gather);
      }
    }
}

TEST_CASE("int8 wire: by default the reduce-scatter from 3 ranks, the all-gather below") {
  // The choice shows in the bytes: at 4 ranks the reduce-scatter sends about half what the all-gather
  // would; at 2 both send one chunk's worth.
  Int8Run m;
  m.seed = 7;
  m.numel = {40000};
  m.dtype = {DDP_F32};
  m.mag = {1.0};
  m.iters = 1;
  unsetenv("DDP_INT8_SCATTER_MIN_WORLD");
  std::vector<uint64_t> sent(4, 0);
  const int failed =
      on_ranks(4, [&](int r, ddp_comm_t c) { return int8_rank(r, 4, c, m, 3, &sent[static_cast<size_t>(r)]); });
  CHECK(failed == 0);
  const uint64_t gather = run_group(4, m, 1 << 30);
  CHECK(sent[0] * 10 < gather * 6);
}

TEST_CASE("int8 wire: rounds of several host tiles, grads that straddle tiles and rounds, both layouts") {
  std::mt19937_64 rng(4711);
  for (int world = 1; world <= 3; ++world)
    for (int arena = 0; arena <= 1; ++arena) {
      Int8Run m;
      m.seed = rng();
      m.arena = arena;
      for (size_t n : {size_t(7000), size_t(3), size_t(12000), size_t(511), size_t(9000), size_t(4096)}) {
        m.numel.push_back(n + rng() % 300);
        m.dtype.push_back(rng() % 4 ? DDP_F32 : DDP_F64);
        m.mag.push_back(std::ldexp(1.0, static_cast<int>(rng() % 17) - 8));
      }
      m.piece_bytes = 40960;  // rounds of 40 f32 blocks, 2.5 tiles of 16
      run_group(world, m, 1 << 30);
    }
}

// The past-fp32 rule (include/ddp.h, DDP_COMPRESS_INT8): in an f64 bucket, a magnitude past FLT_MAX
// in what a rank quantizes cannot travel with an fp32 scale. Its block must come back NaN on every
// rank, on every path (the all-gather whole and in rounds, the reduce-scatter, copy and arena),
// for any such magnitude: up to about 4.3e40 the scale (max / 127) still fits in fp32, which once
// let a whole block come back finite and wrong. The next iteration is clean (the error dropped); FLT_MAX
// itself travels; a sum past FLT_MAX is NaN where it is re-quantized (reduce-scatter) and carried
// where it is not (all-gather). Every other value equals the float64 model bit for bit.
TEST_CASE("int8 wire: an f64 magnitude from FLT_MAX to 1e300 makes its block NaN on every rank, every path") {
  std::mt19937_64 rng(3838);
  const double above = std::nextafter(static_cast<double>(FLT_MAX), INFINITY);
  int trial = 0;
  for (int world = 2; world <= 4; ++world)
    for (int path = 0; path < 3; ++path)
      for (int arena = 0; arena <= 1; ++arena, ++trial) {
        Int8Run m;
        m.seed = rng();
        m.arena = arena;
        m.iters = 4;
        m.piece_bytes = path == 1 ? 4096 : 0;
        m.numel = {700 + rng() % 3000, 1 + rng() % 600, 1 + rng() % 900};
        m.dtype = {DDP_F64, DDP_F32, DDP_F64};
        m.mag = {0.37, 1.0, 1e-3};
        // Iteration 1: one rank's magnitude past FLT_MAX: the smallest, the report's 1e39, then
        // log-uniform up to 1e300, either sign.
        const double lo = std::log10(above);
        double v = trial == 0 ? above : trial == 1 ? 1e39 : std::pow(10.0, lo + (300 - lo) * (rng() % 1000) / 999.0);
        if (rng() % 2) v = -v;
        const int who = static_cast<int>(rng() % static_cast<uint64_t>(world));
        const size_t at = rng() % m.numel[0];
        m.plants.push_back({who, 1, 0, at, v});
        m.expects.push_back({1, 0, at, true});
        m.expects.push_back({2, 0, at, false});  // the next iteration is clean
        // Iteration 2: FLT_MAX itself on one rank travels (with the all-gather; re-quantizing a sum
        // that rounds past it is the next case).
        if (path != 2) {
          const size_t at2 = rng() % m.numel[2];
          m.plants.push_back({static_cast<int>(rng() % static_cast<uint64_t>(world)), 2, 2, at2, FLT_MAX});
          m.expects.push_back({2, 2, at2, false});
        }
        // Iteration 3: 2.5e38 on every rank: the sum passes FLT_MAX.
        const size_t at3 = rng() % m.numel[0];
        for (int r = 0; r < world; ++r) m.plants.push_back({r, 3, 0, at3, 2.5e38});
        const bool requantized = path == 2 && int8_model::scatters(m.numel[0] + m.numel[2], world, 1);
        m.expects.push_back({3, 0, at3, requantized});
        run_group(world, m, path == 2 ? 1 : 1 << 30);
      }
}

namespace {

// The library memory of one rank's context over one f32 grad of `n` elements with the int8 wire,
// after its commit: library_bytes without the arena's grad storage.
bool int8_memory(ddp_comm_t c, int arena, size_t n, size_t piece_bytes, uint64_t* held) {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.layout = arena;
  cfg.message_size = 1 << 20;
  cfg.compression = DDP_COMPRESS_INT8;
  cfg.host_piece_bytes = piece_bytes;
  ddp_t d = nullptr;
  if (ddp_create(c, &cfg, &d) != DDP_SUCCESS) return false;
  std::vector<float> mem(arena ? 0 : n);
  int index = 0;
  ddp_stats_t st;
  st.size = sizeof st;
  bool ok = ddp_register_grad(d, arena ? nullptr : mem.data(), n, DDP_F32, 0, &index) == DDP_SUCCESS &&
            ddp_commit(d) == DDP_SUCCESS && ddp_get_stats(d, &st) == DDP_SUCCESS;
  *held = ok ? st.library_bytes - st.arena_bytes : 0;
  return ddp_destroy(d) == DDP_SUCCESS && ok;
}

}  // namespace

// The int8 collectives that read and write the grads themselves (host memory) need no staging copy
// of the bucket: the copy layout holds what the arena layout holds besides its grads, plus, for the
// reduce-scatter, this rank's shard of f32 sums (it used to stage the whole bucket).
TEST_CASE("int8 wire: the copy layout stages no bucket: nothing for the rounds, one shard for the reduce-scatter") {
  const size_t n = 30000;
  for (int world = 2; world <= 3; ++world)
    for (int scatter = 0; scatter <= 1; ++scatter) {
      setenv("DDP_INT8_SCATTER_MIN_WORLD", scatter ? "2" : "1000", 1);
      std::vector<uint64_t> copy(static_cast<size_t>(world)), arena(copy);
      const size_t piece = 40960;  // the all-gather goes in rounds
      CHECK(on_ranks(world, [&](int r, ddp_comm_t c) {
              return int8_memory(c, 0, n, piece, &copy[static_cast<size_t>(r)]) &&
                     int8_memory(c, 1, n, piece, &arena[static_cast<size_t>(r)]);
            }) == 0);
      for (int r = 0; r < world; ++r) {
        const uint64_t staged = copy[static_cast<size_t>(r)] - arena[static_cast<size_t>(r)];
        const uint64_t shard = scatter ? (n + static_cast<size_t>(world) - 1) / static_cast<size_t>(world) * 4 : 0;
        CHECK_MESSAGE(staged <= shard + 256 * 4, "world ", world, " rank ", r,
                      std::string(scatter ? " scatter" : " rounds"), ": the copy layout holds ", staged,
                      " bytes more than the arena's, over ", n * 4, " of grads");
      }
    }
  unsetenv("DDP_INT8_SCATTER_MIN_WORLD");
}
