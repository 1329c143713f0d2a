// Test support shared by the multi-rank tests: deterministic per-rank grad values that every rank can
// compute for every other rank (so the float64 reference needs no communication), 16-bit rounding
// through an independent path (the compiler's _Float16 and a bit-exact bf16 rounder written apart from
// the library's), and the tolerance rules.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ddp.h"

namespace ref {

inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A value in [-2, 2) that depends on every argument.
inline double raw_value(uint64_t seed, int rank, int iter, int grad, size_t i) {
  uint64_t h = mix(seed ^ mix(static_cast<uint64_t>(rank) * 1000003u ^
                              mix(static_cast<uint64_t>(iter) * 7919u ^ mix(static_cast<uint64_t>(grad) ^ mix(i)))));
  return (static_cast<double>(h >> 11) / 9007199254740992.0) * 4.0 - 2.0;
}

// Round-to-nearest-even bf16 via double arithmetic (independent of the library's bit trick).
inline float round_bf16(float f) {
  if (std::isnan(f) || std::isinf(f) || f == 0.0f) return f;
  int e;
  std::frexp(static_cast<double>(f), &e);               // |f| in [2^(e-1), 2^e)
  double ulp = std::ldexp(1.0, std::max(e - 8, -133));  // 8 significant bits; subnormals below 2^-126
  double q = static_cast<double>(f) / ulp;
  double r = std::nearbyint(q);  // default rounding mode: nearest even
  double v = r * ulp;
  if (std::fabs(v) >= 3.40282356779733661637539395458142568448e38)
    return f > 0 ? INFINITY : -INFINITY;  // past FLT_MAX + ulp/2
  return static_cast<float>(v);
}

inline double quantize(double v, ddp_dtype_t d) {
  switch (d) {
    case DDP_F16: return static_cast<double>(static_cast<float>(static_cast<_Float16>(static_cast<float>(v))));
    case DDP_BF16: return static_cast<double>(round_bf16(static_cast<float>(v)));
    case DDP_F32: return static_cast<double>(static_cast<float>(v));
    default: return v;
  }
}

inline double load(const void* p, size_t i, ddp_dtype_t d) {
  switch (d) {
    case DDP_F16: {
      _Float16 h;
      std::memcpy(&h, static_cast<const char*>(p) + 2 * i, 2);
      return static_cast<double>(static_cast<float>(h));
    }
    case DDP_BF16: {
      uint16_t b;
      std::memcpy(&b, static_cast<const char*>(p) + 2 * i, 2);
      uint32_t u = static_cast<uint32_t>(b) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    case DDP_F32: return static_cast<const float*>(p)[i];
    default: return static_cast<const double*>(p)[i];
  }
}

// Stores a value already representable in d.
inline void store(void* p, size_t i, ddp_dtype_t d, double v) {
  switch (d) {
    case DDP_F16: {
      _Float16 h = static_cast<_Float16>(static_cast<float>(v));
      std::memcpy(static_cast<char*>(p) + 2 * i, &h, 2);
      break;
    }
    case DDP_BF16: {
      float f = static_cast<float>(v);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      uint16_t b = static_cast<uint16_t>(u >> 16);  // exact: v is a bf16 value
      std::memcpy(static_cast<char*>(p) + 2 * i, &b, 2);
      break;
    }
    case DDP_F32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    default: static_cast<double*>(p)[i] = v; break;
  }
}

inline size_t dsize(ddp_dtype_t d) { return d == DDP_F64 ? 8 : d == DDP_F32 ? 4 : 2; }

// The spacing of d's values around |x| (one unit in the last place).
inline double ulp(double x, ddp_dtype_t d) {
  int mant = d == DDP_F16 ? 11 : d == DDP_BF16 ? 8 : d == DDP_F32 ? 24 : 53;
  int emin = d == DDP_F16 ? -14 : d == DDP_BF16 ? -126 : d == DDP_F32 ? -126 : -1022;
  int e;
  std::frexp(x, &e);
  if (x == 0.0 || e - 1 < emin) e = emin + 1;
  return std::ldexp(1.0, e - mant);
}

// Whether `got` is the reduced value: f32/f64 within `rel` of the magnitude of the summed terms
// (`mag` = scale * sum |g_r|); 16-bit within one rounding of the exact result.
inline bool close(double got, double want, double mag, ddp_dtype_t d) {
  if (std::isnan(got) || std::isnan(want)) return std::isnan(got) && std::isnan(want);
  double err = std::fabs(got - want);
  switch (d) {
    case DDP_F64: return err <= 1e-12 * mag + 1e-300;
    case DDP_F32: return err <= 1e-6 * mag + 1e-38;
    default: return err <= ulp(want, d) + 1e-6 * mag;  // one rounding (<= 1/2 ulp) plus fp32 arithmetic
  }
}

// A 16-bit bucket summed on its own wire (NCCL without allreduce_always_fp32): each input may be
// rounded once more (premultiplied in 16 bits), so beyond close() the error may reach the 16-bit
// type's unit roundoff at the inputs' magnitude.
inline bool close_native16(double got, double want, double mag, ddp_dtype_t d) {
  if (close(got, want, mag, d)) return true;
  const double rel = d == DDP_F16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  return std::fabs(got - want) <= ulp(want, d) + rel * mag;
}

}  // namespace ref
