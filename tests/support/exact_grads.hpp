// Shared by the fault, thread and fuzz tests: grads with deterministic values exact in every dtype, and their
// reference reduction.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ddp.h"

namespace faults {

inline double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline size_t esize(ddp_dtype_t d) { return d == DDP_F64 ? 8 : d == DDP_F32 ? 4 : 2; }

// Values are multiples of 1/4 in [-8, 8]: their sums over a few ranks and their averages over 2 or 4
// ranks are exact in every dtype, so results can be compared bit for bit.
inline double value(uint64_t seed, int rank, int iter, int grad, size_t i) {
  uint64_t h =
      seed * 0x9E3779B97F4A7C15ull ^ (uint64_t(rank) << 48) ^ (uint64_t(iter) << 32) ^ (uint64_t(grad) << 20) ^ i;
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  return static_cast<double>(static_cast<int>(h % 65) - 32) / 4.0;
}

inline uint16_t to_half(double v) {  // exact inputs only (quarters, NaN, Inf)
  if (std::isnan(v)) return 0x7e00;
  uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  double a = std::fabs(v);
  if (std::isinf(a)) return sign | 0x7c00;
  if (a == 0) return sign;
  int e;
  double m = std::frexp(a, &e);
  int exp = e - 1 + 15;
  if (exp <= 0) return sign | static_cast<uint16_t>(std::lround(std::ldexp(a, 24)));
  return sign | static_cast<uint16_t>(exp << 10) | static_cast<uint16_t>(std::lround((m * 2 - 1) * 1024));
}
inline double from_half(uint16_t h) {
  int exp = (h >> 10) & 31, mant = h & 1023;
  double v = exp == 0 ? std::ldexp(mant, -24) : exp == 31 ? (mant ? NAN : INFINITY) : std::ldexp(mant | 1024, exp - 25);
  return (h >> 15) ? -v : v;
}

inline void store(void* p, size_t i, ddp_dtype_t d, double v) {
  switch (d) {
    case DDP_F16: static_cast<uint16_t*>(p)[i] = to_half(v); break;
    case DDP_BF16: {
      float f = static_cast<float>(v);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(u >> 16);
      break;
    }
    case DDP_F32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    default: static_cast<double*>(p)[i] = v;
  }
}
inline double load(const void* p, size_t i, ddp_dtype_t d) {
  switch (d) {
    case DDP_F16: return from_half(static_cast<const uint16_t*>(p)[i]);
    case DDP_BF16: {
      uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    case DDP_F32: return static_cast<const float*>(p)[i];
    default: return static_cast<const double*>(p)[i];
  }
}

struct Grad {
  size_t numel;
  ddp_dtype_t dtype;
  int index = -1;
  std::vector<unsigned char> buf;
};

// A mix of sizes and dtypes, the same on every rank.
inline std::vector<Grad> make_grads(int n) {
  static const ddp_dtype_t types[4] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16};
  std::vector<Grad> g;
  for (int i = 0; i < n; ++i) {
    Grad x;
    x.numel = 37 + static_cast<size_t>((i * 977) % 1500);
    x.dtype = types[i % 4];
    x.buf.assign(x.numel * esize(x.dtype), 0);
    g.push_back(std::move(x));
  }
  return g;
}

}  // namespace faults
