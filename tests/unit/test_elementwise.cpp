// The element operations shared by the host backend and the CUDA kernels, against independent
// references: the compiler's _Float16 for binary16 and a double-based rounder for bfloat16.
#include <doctest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kernels/elementwise.h"
#include "../support/reference.hpp"
#include "host/host_device.hpp"

using namespace ddp;

static uint16_t f16_bits_of(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

TEST_CASE("f16: every bit pattern converts to f32 and back exactly") {
  for (uint32_t b = 0; b < 65536; ++b) {
    uint16_t h = static_cast<uint16_t>(b);
    float f = elem::f16_to_f32(h);
    _Float16 want;
    std::memcpy(&want, &h, 2);
    if (std::isnan(f)) {
      CHECK(std::isnan(static_cast<float>(want)));
      CHECK(std::isnan(elem::f16_to_f32(elem::f32_to_f16(f))));
      continue;
    }
    REQUIRE(f == static_cast<float>(want));
    REQUIRE(elem::f32_to_f16(f) == h);
  }
}

TEST_CASE("f16: f32 rounding matches the compiler's, ties and subnormals included") {
  std::mt19937 rng(7);
  int mismatches = 0;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = rng();
    if (i % 3 == 0) u = (u & 0x807fffffu) | ((100u + (rng() % 45u)) << 23);  // near the f16 range
    if (i % 7 == 0) u &= 0xffffe000u | 0x1000u;                              // exact ties
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    mismatches += elem::f32_to_f16(f) != f16_bits_of(f);
  }
  CHECK(mismatches == 0);
  CHECK(elem::f32_to_f16(65504.0f) == 0x7bff);
  CHECK(elem::f32_to_f16(65520.0f) == 0x7c00);  // rounds to infinity
  CHECK(elem::f32_to_f16(-1e30f) == 0xfc00);
  CHECK(elem::f32_to_f16(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(elem::f32_to_f16(std::ldexp(1.0f, -25)) == 0x0000);  // tie to even
}

TEST_CASE("bf16: rounding matches round-to-nearest-even, NaN stays NaN") {
  std::mt19937 rng(11);
  int mismatches = 0;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = rng();
    if (i % 5 == 0) u = (u & 0xffff0000u) | 0x8000u;  // exact ties
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f) || std::isinf(f)) continue;
    float got = elem::bf16_to_f32(elem::f32_to_bf16(f));
    float want = ref::round_bf16(f);
    mismatches += !(got == want || (std::isinf(want) && std::isinf(got)));
  }
  CHECK(mismatches == 0);
  CHECK(std::isnan(elem::bf16_to_f32(elem::f32_to_bf16(std::nanf("")))));
  CHECK(elem::f32_to_bf16(3.38953139e38f) == 0x7f7f);  // the largest finite bf16
  CHECK(elem::f32_to_bf16(3.40282347e38f) == 0x7f80);  // FLT_MAX rounds up to infinity
}

TEST_CASE("scaled casts round once") {
  // f32 -> f16 with a scale: the product is rounded to f16 once, from f32.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  for (int i = 0; i < 10000; ++i) {
    float v = dist(rng);
    uint16_t got = elem::scaled_cast<elem::F32, elem::F16>(v, 0.25, false);
    CHECK(got == f16_bits_of(v * 0.25f));
  }
  // unit scale is bit-exact, NaN and infinities pass through
  CHECK(elem::scaled_cast<elem::F64, elem::F64>(0.1, 1.0, true) == 0.1);
  CHECK(std::isnan(elem::scaled_cast<elem::F32, elem::F32>(std::nanf(""), 0.5, false)));
  CHECK(std::isinf(elem::scaled_cast<elem::F32, elem::F32>(INFINITY, 0.5, false)));
}

TEST_CASE("host convert: every dtype pair with scaling, against float64") {
  const Dtype types[] = {Dtype::F16, Dtype::BF16, Dtype::F32, Dtype::F64};
  const ddp_dtype_t ctypes[] = {DDP_F16, DDP_BF16, DDP_F32, DDP_F64};
  std::mt19937_64 rng(5);
  for (int s = 0; s < 4; ++s)
    for (int d = 0; d < 4; ++d)
      for (double scale : {1.0, 0.5, 1.0 / 3.0}) {
        const size_t n = 1 + rng() % 500;
        std::vector<char> src(n * 8), dst(n * 8);
        for (size_t i = 0; i < n; ++i)
          ref::store(src.data(), i, ctypes[s],
                     ref::quantize(static_cast<double>(rng() % 20000) / 97.0 - 100.0, ctypes[s]));
        host::convert(src.data(), types[s], dst.data(), types[d], n, scale);
        for (size_t i = 0; i < n; ++i) {
          double want = ref::load(src.data(), i, ctypes[s]) * scale;
          double got = ref::load(dst.data(), i, ctypes[d]);
          REQUIRE(ref::close(got, want, std::fabs(want), ctypes[d]));
        }
      }
}

TEST_CASE("non-finite detection") {
  std::vector<float> v(100, 1.0f);
  CHECK_FALSE(host::has_nonfinite(v.data(), v.size(), Dtype::F32));
  v[57] = INFINITY;
  CHECK(host::has_nonfinite(v.data(), v.size(), Dtype::F32));
  v[57] = std::nanf("");
  CHECK(host::has_nonfinite(v.data(), v.size(), Dtype::F32));
  uint16_t h[3] = {0x3c00, 0x7c00, 0};
  CHECK(host::has_nonfinite(h, 3, Dtype::F16));
  CHECK_FALSE(host::has_nonfinite(h, 1, Dtype::F16));
  uint16_t b[2] = {0x3f80, 0x7fc0};
  CHECK(host::has_nonfinite(b, 2, Dtype::BF16));
  CHECK_FALSE(host::has_nonfinite(b, 1, Dtype::BF16));
}
