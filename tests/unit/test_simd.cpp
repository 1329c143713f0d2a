// The host loops' two paths, the portable element code and the AVX2 / F16C versions
// (lib/host/host_simd.cpp), against each other bit for bit through host::convert, host::sum_scaled
// and the int8 wire, both chosen in this process through DDP_HOST_SIMD. Every rank, and the GPU
// kernels, must put the same bits on the wire whichever path a rank's CPU takes, so no tolerance:
// random bit patterns, and the edge values of each conversion (NaN payloads, Infs, denormals, ties,
// fp16 overflow, bf16 carries; int8 blocks of NaN, Inf, zeros and maxima below 1 / FLT_MAX).
#include <doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "host/host_kernels.hpp"
#include "host/host_simd.hpp"
#include "kernels/elementwise.h"

using namespace ddp;

namespace {

// The host loops on one path for a scope: DDP_HOST_SIMD set and the choice made again.
struct OnPath {
  explicit OnPath(bool simd) {
    setenv("DDP_HOST_SIMD", simd ? "1" : "0", 1);
    host::choose_simd_path_again();
  }
  ~OnPath() {
    unsetenv("DDP_HOST_SIMD");
    host::choose_simd_path_again();
  }
};

bool have_simd() {
  if (host::simd::supported()) return true;
  MESSAGE("this CPU has no AVX2 / F16C: only the portable path runs here");
  return false;
}

float f32(uint32_t u) { return elem::bits_f32(u); }

// f32 values at every edge the 16-bit conversions have, both signs, among random bit patterns.
std::vector<float> edge_floats(size_t n, uint32_t seed) {
  const uint32_t edges[] = {
      0x7f800000, 0x7f800001, 0x7fc00000, 0x7fa12345, 0x7fffffff, 0xffc00001,  // Inf, NaNs (quiet, signaling)
      0x00000000, 0x00000001, 0x007fffff, 0x00800000,                          // zero, f32 denormals
      0x477fe000, 0x477fefff, 0x477ff000, 0x477fffff, 0x47800000, 0x7f7fffff,  // fp16's top: 65504 .. Inf
      0x33000000, 0x33000001, 0x33800000, 0x33c00000, 0x38800000, 0x387fffff,  // fp16 subnormals, ties
      0x38801000, 0x38803000, 0x3f801000, 0x3f803000, 0x3f800fff,              // fp16 ties to even
      0x3f808000, 0x3f818000, 0x3f80ffff, 0x7f7f8000, 0x7f7fffff, 0x3fffffff,  // bf16 ties and carries
      0x3f7fffff, 0x00008000, 0x00018000, 0x0000ffff};
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  const size_t ne = sizeof edges / sizeof edges[0];
  for (size_t i = 0; i < n; ++i) {
    uint32_t u = rng();
    if (i % 3 == 0) u = (u & 0x807fffffu) | ((100u + rng() % 45u) << 23);  // near fp16's range
    if (i % 5 == 0) u = edges[rng() % ne] | (rng() & 0x80000000u);
    if (i % 7 == 0) u &= 0xffffe000u | 0x1000u;        // fp16 ties
    if (i % 11 == 0) u = (u & 0xffff0000u) | 0x8000u;  // bf16 ties
    v[i] = f32(u);
  }
  return v;
}

std::vector<uint16_t> random_halves(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint16_t>(rng());
  return v;
}

std::vector<char> bytes_of(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  return std::vector<char>(c, c + n);
}

// host::convert of src (n elements of s) to d on the given path, as bytes.
std::vector<char> convert_on(bool simd, const void* src, Dtype s, Dtype d, size_t n, double scale) {
  OnPath path(simd);
  REQUIRE(host::simd_path() == simd);
  std::vector<char> out(n * dtype_size(d) + 1, 0x5a);
  host::convert(src, s, out.data(), d, n, scale);
  return out;
}

const double kScales[] = {1.0, 0.5, 1.0 / 3.0, 3.0e-5, 65536.0, 1e-40};
const size_t kSizes[] = {1, 7, 8, 9, 17, 255, 1000, 4099};

}  // namespace

TEST_CASE("host SIMD path: DDP_HOST_SIMD=0 keeps the portable loops; otherwise the CPU decides, once") {
  {
    OnPath path(false);
    CHECK_FALSE(host::simd_path());
  }
  {
    OnPath path(true);
    CHECK(host::simd_path() == host::simd::supported());
    setenv("DDP_HOST_SIMD", "0", 1);  // read once: a later change waits for the next choice
    CHECK(host::simd_path() == host::simd::supported());
  }
  CHECK(host::simd_path() == host::simd::supported());  // unset: the default is the CPU's answer
}

TEST_CASE("host SIMD path: f32 -> fp16 / bf16 with a scale, bit for bit the portable casts") {
  if (!have_simd()) return;
  for (size_t n : kSizes)
    for (double scale : kScales)
      for (Dtype d : {Dtype::F16, Dtype::BF16}) {
        const std::vector<float> x = edge_floats(n, static_cast<uint32_t>(n * 31 + (d == Dtype::F16)));
        INFO("n ", n, " scale ", scale, " to ", dtype_name(d));
        REQUIRE(convert_on(true, x.data(), Dtype::F32, d, n, scale) ==
                convert_on(false, x.data(), Dtype::F32, d, n, scale));
      }
}

TEST_CASE("host SIMD path: fp16 / bf16 -> f32, every bit pattern and with scales, bit for bit") {
  if (!have_simd()) return;
  std::vector<uint16_t> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) all[b] = static_cast<uint16_t>(b);
  for (Dtype s : {Dtype::F16, Dtype::BF16}) {
    INFO("from ", dtype_name(s));
    for (double scale : kScales)
      REQUIRE(convert_on(true, all.data(), s, Dtype::F32, all.size(), scale) ==
              convert_on(false, all.data(), s, Dtype::F32, all.size(), scale));
    for (size_t n : kSizes) {
      const std::vector<uint16_t> h = random_halves(n, static_cast<uint32_t>(n));
      REQUIRE(convert_on(true, h.data(), s, Dtype::F32, n, 0.25) ==
              convert_on(false, h.data(), s, Dtype::F32, n, 0.25));
    }
  }
}

TEST_CASE("host SIMD path: the 16-bit sums of the host reductions, in place or not, bit for bit") {
  if (!have_simd()) return;
  for (size_t n : kSizes)
    for (double scale : {1.0, 0.5, 1.0 / 3.0})
      for (Dtype d : {Dtype::F16, Dtype::BF16})
        for (bool in_place : {false, true}) {
          INFO("n ", n, " scale ", scale, " ", dtype_name(d), in_place ? " in place" : "");
          const std::vector<uint16_t> a = random_halves(n, static_cast<uint32_t>(n)), b = random_halves(n, 99);
          std::vector<char> got[2];
          for (bool simd : {false, true}) {
            OnPath path(simd);
            std::vector<uint16_t> x = a, out(n, 0x5a5a);
            host::sum_scaled(x.data(), b.data(), in_place ? x.data() : out.data(), n, d, scale);
            got[simd] = bytes_of(in_place ? x.data() : out.data(), n * 2);
          }
          REQUIRE(got[0] == got[1]);
        }
}

namespace {

// An int8 wire input of n elements: random magnitudes over many binades, with one of the edge cases
// spread over it (kind 0: none).
std::vector<float> int8_input(size_t n, int kind, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 17) - 8);
  const float tiny[] = {3.0e-37f, 1.0e-38f, 1.0e-40f, 1.0e-44f};
  for (size_t i = 0; i < n; ++i) switch (kind) {
      case 1: x[i] = i % 3 == 0 ? 0.0f : x[i] * tiny[(i / 256) % 4] / 256.0f; break;  // max < 3.7e-37
      case 2: x[i] = i % 97 == 5 ? std::nanf("") : x[i]; break;                       // NaN blocks
      case 3: x[i] = i == n / 2 ? -INFINITY : x[i]; break;                            // an Inf block
      case 4: x[i] = i % 256 < 200 ? 0.0f : x[i]; break;                              // zero blocks
      case 5: x[i] = std::round(x[i] * 4.0f) / 4.0f; break;  // halves of steps: ties of the rounding
      case 6: x[i] = edge_floats(1, seed + static_cast<uint32_t>(i))[0]; break;
      default: break;
    }
  return x;
}

}  // namespace

TEST_CASE("host SIMD path: int8 quantize (3 error-feedback rounds) and dequantized sum, bit for bit") {
  if (!have_simd()) return;
  const int world = 3;
  for (size_t n : {size_t(1), size_t(7), size_t(9), size_t(255), size_t(256), size_t(257), size_t(700)})
    for (int kind = 0; kind <= 6; ++kind) {
      INFO("n ", n, " kind ", kind);
      const size_t cb = elem::int8_chunk_bytes(n);
      std::vector<char> chunks[2];
      std::vector<float> residual[2][world], out[2];
      for (bool simd : {false, true}) {
        OnPath path(simd);
        chunks[simd].assign(cb * world, 0x5a);
        for (int r = 0; r < world; ++r) {
          const std::vector<float> x = int8_input(n, kind, static_cast<uint32_t>(n * 7 + r));
          residual[simd][r].assign(n, 0.0f);
          for (int round = 0; round < 3; ++round)  // the last round's chunk is summed
            host::int8_quantize(x.data(), Dtype::F32, n, residual[simd][r].data(), chunks[simd].data() + r * cb);
        }
        out[simd].assign(n, -1.0f);
        host::int8_dequant_sum(chunks[simd].data(), cb, world, n, Dtype::F32, out[simd].data());
      }
      REQUIRE(chunks[0] == chunks[1]);
      for (int r = 0; r < world; ++r)
        REQUIRE(bytes_of(residual[0][r].data(), n * 4) == bytes_of(residual[1][r].data(), n * 4));
      REQUIRE(bytes_of(out[0].data(), n * 4) == bytes_of(out[1].data(), n * 4));
    }
}
