// The int8 wire's element operations (kernels/elementwise.h, run by host/host_kernels.cpp): each
// block's scale and rounding against a float64 reference, the error feedback's bookkeeping (what is
// sent plus what is kept is what came in), NaN blocks, and the rank-order dequantized sum; and the
// GPU kernels' thread bodies compiled as nvcc compiles them (a * b + c contracted into an FMA)
// against the host loops, bit for bit.
//
// This unit's copy of the element code stores its explicitly rounded products through a volatile
// (DDP_ELEM_CONTRACTS, kernels/elementwise.h), as __fmul_rn keeps them on a GPU, so its references
// and thread bodies round the same whatever flags the tests are built with.
#define DDP_ELEM_CONTRACTS 1
#include <doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "host/host_kernels.hpp"
#include "kernels/elementwise.h"
#include "kernels/kernel_bodies.h"

using namespace ddp;

namespace {

// A rank's chunk, read back: scale of block b, value i.
struct Chunk {
  std::vector<char> bytes;
  size_t n;
  explicit Chunk(size_t n_) : bytes(elem::int8_chunk_bytes(n_), 0x5a), n(n_) {}
  float scale(size_t b) const {
    float s;
    std::memcpy(&s, bytes.data() + 4 * b, 4);
    return s;
  }
  int q(size_t i) const { return reinterpret_cast<const int8_t*>(bytes.data() + 4 * elem::int8_blocks(n))[i]; }
};

std::vector<float> random_floats(size_t n, uint32_t seed, float spread) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 9) - 4) * spread;
  return v;
}

// The thread bodies over a grid, compiled with contraction on and FMA instructions, as nvcc compiles
// them: `flatten` inlines every element function here, where contraction happens. GCC contracts by
// default in C++; on x86 FMA needs the target attribute (and the CPU, checked before calling them).
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define AS_NVCC __attribute__((target("fma"), flatten))
bool can_contract() { return __builtin_cpu_supports("fma"); }
#elif defined(__GNUC__) && !defined(__clang__) && defined(__aarch64__)
#define AS_NVCC __attribute__((flatten))
bool can_contract() { return true; }
#else
#define AS_NVCC
bool can_contract() { return false; }
#endif

AS_NVCC void quantize_grid(const float* x, float* residual, size_t n, char* chunk) {
  for (size_t blk = 0; blk < 2; ++blk)  // 2 blocks of 3 threads, every thread striding over int8 blocks
    for (size_t t = 0; t < 3; ++t) kern::int8_quantize_thread<elem::F32>(x, residual, n, chunk, blk, t, 3, 2);
}

AS_NVCC void dequant_grid(const char* chunks, size_t cb, int world, size_t n, float* out) {
  for (size_t blk = 0; blk < 4; ++blk)
    for (size_t t = 0; t < 32; ++t) kern::int8_dequant_thread<elem::F32>(chunks, cb, world, n, out, blk, t, 32, 4);
}

// (1 + 2^-23)^2 - (1 + 2^-22) is 2^-46 when fused into one FMA, 0 with the product rounded first.
AS_NVCC float contracted_residue(float a, float c) { return a * a - c; }
AS_NVCC float rounded_residue(float a, float c) { return elem::add_rn(elem::mul_rn(a, a), -c); }

}  // namespace

TEST_CASE("int8: chunk sizes: a scale per 256-element block, then the values, padded to 8 bytes") {
  CHECK(elem::int8_chunk_bytes(0) == 0);
  CHECK(elem::int8_chunk_bytes(1) == 8);
  CHECK(elem::int8_chunk_bytes(256) == 264);
  CHECK(elem::int8_chunk_bytes(257) == 272);  // 2 scales + 257 values = 265 -> 272
  CHECK(elem::int8_blocks(513) == 3);
}

TEST_CASE("int8: each block's scale is its largest magnitude / 127; values round to nearest; sent + kept = input") {
  for (size_t n : {size_t(1), size_t(255), size_t(256), size_t(700)}) {
    std::vector<float> x = random_floats(n, static_cast<uint32_t>(n), 3.0f);
    std::vector<float> residual(n, 0.0f);
    Chunk c(n);
    host::int8_quantize(x.data(), Dtype::F32, n, residual.data(), c.bytes.data());
    for (size_t b = 0; b * 256 < n; ++b) {
      float amax = 0;
      for (size_t i = b * 256; i < std::min(n, b * 256 + 256); ++i) amax = std::max(amax, std::fabs(x[i]));
      REQUIRE(c.scale(b) == amax / 127.0f);
      for (size_t i = b * 256; i < std::min(n, b * 256 + 256); ++i) {
        const double s = c.scale(b);
        // Round to nearest: the value sent is within half a step of the input.
        REQUIRE(std::fabs(c.q(i) * s - x[i]) <= 0.5 * s * (1 + 1e-6));
        REQUIRE(std::abs(c.q(i)) <= 127);
        // What is kept is exactly what was not sent (to fp32 rounding of the difference).
        REQUIRE(std::fabs(static_cast<double>(residual[i]) - (x[i] - c.q(i) * s)) <= 1e-7 * std::fabs(x[i]) + 1e-30);
      }
    }
  }
}

TEST_CASE("int8: error feedback: a constant input's sent values average to it") {
  const size_t n = 300;
  std::vector<float> x = random_floats(n, 11, 1.0f);
  std::vector<float> residual(n, 0.0f);
  std::vector<double> sent(n, 0.0);
  const int rounds = 64;
  for (int t = 0; t < rounds; ++t) {
    Chunk c(n);
    host::int8_quantize(x.data(), Dtype::F32, n, residual.data(), c.bytes.data());
    for (size_t i = 0; i < n; ++i) sent[i] += c.q(i) * static_cast<double>(c.scale(i / 256));
  }
  // The mean is off by at most (first kept error - last kept error) / rounds: a step / rounds.
  double worst_with = 0, worst_without = 0;
  Chunk plain(n);
  std::vector<float> none(n, 0.0f);
  host::int8_quantize(x.data(), Dtype::F32, n, none.data(), plain.bytes.data());
  for (size_t i = 0; i < n; ++i) {
    const double step = plain.scale(i / 256);
    worst_with = std::max(worst_with, std::fabs(sent[i] / rounds - x[i]) / step);
    worst_without = std::max(worst_without, std::fabs(plain.q(i) * step - x[i]) / step);
  }
  CHECK(worst_with <= 1.5 / rounds);
  CHECK(worst_without > 0.3);  // without feedback the same rounding repeats: the test can fail
}

TEST_CASE("int8: a block with a NaN or Inf is sent as NaN and its error dropped; other blocks are untouched") {
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    const size_t n = 600;
    std::vector<float> x = random_floats(n, 5, 1.0f);
    x[300] = bad;  // block 1
    std::vector<float> residual(n, 0.25f);
    Chunk c(n);
    host::int8_quantize(x.data(), Dtype::F32, n, residual.data(), c.bytes.data());
    CHECK(std::isnan(c.scale(1)));
    CHECK(std::isfinite(c.scale(0)));
    CHECK(std::isfinite(c.scale(2)));
    for (size_t i = 256; i < 512; ++i) REQUIRE(residual[i] == 0.0f);
    std::vector<float> out(n);
    host::int8_dequant_sum(c.bytes.data(), c.bytes.size(), 1, n, Dtype::F32, out.data());
    for (size_t i = 0; i < n; ++i) REQUIRE(std::isnan(out[i]) == (i >= 256 && i < 512));
  }
}

TEST_CASE("int8: f64 buckets: fp64 math; magnitudes past fp32's range give NaN, not a wrong finite value") {
  const size_t n = 10;
  std::vector<double> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = (static_cast<double>(i) - 4.5) * 1e-3;
  std::vector<float> residual(n, 0.0f);
  Chunk c(n);
  host::int8_quantize(x.data(), Dtype::F64, n, residual.data(), c.bytes.data());
  CHECK(c.scale(0) == static_cast<float>(4.5e-3 / 127));
  std::vector<double> out(n);
  host::int8_dequant_sum(c.bytes.data(), c.bytes.size(), 1, n, Dtype::F64, out.data());
  for (size_t i = 0; i < n; ++i) CHECK(std::fabs(out[i] - x[i]) <= 0.5 * c.scale(0) * (1 + 1e-6));
  x[3] = 1e300;
  host::int8_quantize(x.data(), Dtype::F64, n, residual.data(), c.bytes.data());
  CHECK(std::isnan(c.scale(0)));
  // Every magnitude past FLT_MAX, not only those whose scale (max / 127) overflows fp32 (from about
  // 4.3e40): 1e39 once came back as 9.99999969e38 and its block's small values as zeros.
  x[3] = -1.5e-3;
  const double above = std::nextafter(static_cast<double>(FLT_MAX), INFINITY);
  for (int k = 0; k <= 200; ++k) {
    const double v = k == 0 ? above : std::pow(10.0, std::log10(above) + (300 - std::log10(above)) * k / 200.0);
    for (double sign : {1.0, -1.0}) {
      std::fill(residual.begin(), residual.end(), 0.25f);
      x[7] = sign * v;
      host::int8_quantize(x.data(), Dtype::F64, n, residual.data(), c.bytes.data());
      CAPTURE(v);
      CHECK(std::isnan(c.scale(0)));
      CHECK(std::all_of(residual.begin(), residual.end(), [](float e) { return e == 0.0f; }));  // dropped
    }
  }
  x[7] = FLT_MAX;  // the largest magnitude that travels
  host::int8_quantize(x.data(), Dtype::F64, n, residual.data(), c.bytes.data());
  CHECK(std::isfinite(c.scale(0)));
  host::int8_dequant_sum(c.bytes.data(), c.bytes.size(), 1, n, Dtype::F64, out.data());
  CHECK(std::fabs(out[7] - FLT_MAX) <= 0.5 * c.scale(0) * (1 + 1e-6));
}

TEST_CASE("int8: a zero block sends zeros with scale 0") {
  std::vector<float> x(40, 0.0f), residual(40, 0.0f), out(40, 1.0f);
  Chunk c(40);
  host::int8_quantize(x.data(), Dtype::F32, 40, residual.data(), c.bytes.data());
  CHECK(c.scale(0) == 0.0f);
  host::int8_dequant_sum(c.bytes.data(), c.bytes.size(), 1, 40, Dtype::F32, out.data());
  for (float v : out) CHECK(v == 0.0f);
}

TEST_CASE("int8: tiny blocks (max below 127 / FLT_MAX, down to denormals) stay finite and within half a step") {
  // 1 / scale overflows to +Inf once the scale is below 1 / FLT_MAX (a block max below ~3.7e-37):
  // zeros then became NaN residuals (Inf * 0) and the whole block NaN from the next iteration on.
  for (float amax : {3.0e-37f, 1.0e-38f, 1.0e-40f, 1.0e-44f}) {
    const size_t n = 300;  // a full block and a partial one
    std::vector<float> x = random_floats(n, 7, 1.0f), residual(n, 0.0f), out(n, 0.0f);
    float m = 0;
    for (float v : x) m = std::max(m, std::fabs(v));
    for (size_t i = 0; i < n; ++i) x[i] = i % 3 == 0 ? 0.0f : x[i] / m * amax;  // zeros among them
    for (int iteration = 0; iteration < 3; ++iteration) {
      const std::vector<float> owed_before = residual;
      Chunk c(n);
      host::int8_quantize(x.data(), Dtype::F32, n, residual.data(), c.bytes.data());
      host::int8_dequant_sum(c.bytes.data(), c.bytes.size(), 1, n, Dtype::F32, out.data());
      for (size_t b = 0; b < 2; ++b) REQUIRE(std::isfinite(c.scale(b)));
      for (size_t i = 0; i < n; ++i) {
        INFO("amax ", amax, " iteration ", iteration, " element ", i);
        const double step = c.scale(i / 256), y = static_cast<double>(x[i]) + owed_before[i];
        REQUIRE(std::isfinite(residual[i]));
        REQUIRE(std::isfinite(out[i]));
        REQUIRE(std::abs(c.q(i)) <= 127);
        // Sent + kept = owed, and what is kept is within half a step (round to nearest); a scale
        // below the smallest denormal sends nothing and keeps everything.
        REQUIRE(std::fabs(static_cast<double>(out[i]) + residual[i] - y) <= 1e-6 * std::fabs(y) + 1e-45);
        if (step > 0)
          REQUIRE(std::fabs(static_cast<double>(residual[i])) <= 0.5 * step * (1 + 1e-6) + 1e-45);
        else
          REQUIRE(out[i] == 0.0f);
      }
    }
  }
}

TEST_CASE("int8: the dequantized sum adds every rank's term in rank order, in the bucket type's math") {
  const size_t n = 517;
  const int world = 3;
  std::vector<Chunk> chunks;
  std::vector<char> all;
  for (int r = 0; r < world; ++r) {
    std::vector<float> x = random_floats(n, 100 + static_cast<uint32_t>(r), r == 1 ? 1000.0f : 0.001f);
    std::vector<float> residual(n, 0.0f);
    chunks.emplace_back(n);
    host::int8_quantize(x.data(), Dtype::F32, n, residual.data(), chunks.back().bytes.data());
    all.insert(all.end(), chunks.back().bytes.begin(), chunks.back().bytes.end());
  }
  std::vector<float> out(n);
  host::int8_dequant_sum(all.data(), chunks[0].bytes.size(), world, n, Dtype::F32, out.data());
  for (size_t i = 0; i < n; ++i) {
    float want = 0.0f;
    for (int r = 0; r < world; ++r)
      want = elem::add_rn(want, elem::mul_rn(static_cast<float>(chunks[static_cast<size_t>(r)].q(i)),
                                             chunks[static_cast<size_t>(r)].scale(i / 256)));
    REQUIRE(out[i] == want);  // bit for bit: the same order of fp32 additions, each product rounded
  }
}

TEST_CASE("int8: the GPU kernels' thread bodies, run over a grid as nvcc compiles them, give the host loops' bits") {
  if (!can_contract()) {
    MESSAGE("this CPU or compiler cannot contract a * b + c: the bodies run unfused");
  } else {
    volatile float a = 1.0f + std::ldexp(1.0f, -23), c = 1.0f + std::ldexp(1.0f, -22);  // not folded at compile time
    REQUIRE(contracted_residue(a, c) == std::ldexp(1.0f, -46));                         // this unit does contract
    REQUIRE(rounded_residue(a, c) == 0.0f);                                             // and mul_rn still rounds
  }
  const size_t n = 70001;  // 274 blocks, the last one short
  const int world = 3;
  std::vector<char> host_all, grid_all;
  size_t cb = 0;
  for (int r = 0; r < world; ++r) {
    std::vector<float> x = random_floats(n, 40 + static_cast<uint32_t>(r), 2.0f);
    std::vector<float> res_host(n, 0.01f), res_grid(n, 0.01f);
    Chunk a(n), b(n);
    cb = a.bytes.size();
    host::int8_quantize(x.data(), Dtype::F32, n, res_host.data(), a.bytes.data());
    quantize_grid(x.data(), res_grid.data(), n, b.bytes.data());
    REQUIRE(std::memcmp(a.bytes.data(), b.bytes.data(), 4 * elem::int8_blocks(n) + n) == 0);
    REQUIRE(std::memcmp(res_host.data(), res_grid.data(), n * sizeof(float)) == 0);
    host_all.insert(host_all.end(), a.bytes.begin(), a.bytes.end());
  }
  std::vector<float> out_host(n), out_grid(n);
  host::int8_dequant_sum(host_all.data(), cb, world, n, Dtype::F32, out_host.data());
  dequant_grid(host_all.data(), cb, world, n, out_grid.data());
  size_t differ = 0;
  for (size_t i = 0; i < n; ++i) differ += std::memcmp(&out_host[i], &out_grid[i], sizeof(float)) != 0;
  CHECK(differ == 0);
}
