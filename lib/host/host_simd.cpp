// AVX2 and F16C versions of the compressed wires' host loops (host_simd.hpp). Only these functions
// are compiled for AVX2 (the target attribute), so the library's baseline ISA stays what the build
// says; host_kernels.cpp calls them once supported() said yes. Built with -ffp-contract=off like
// host_kernels.cpp (see the Makefile), and without "fma" in the target: a product and a sum stay two
// roundings, as elem::mul_rn / add_rn keep them in the portable loops and on the GPU.
#include "host/host_simd.hpp"

#include <algorithm>
#include <cstring>

#include "core/common.hpp"
#include "kernels/elementwise.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>

#define DDP_SIMD __attribute__((target("avx2,f16c")))

namespace ddp {
namespace host {
namespace simd {

namespace {

DDP_SIMD inline __m256 scaled(__m256 v, __m256 s, bool unit) { return unit ? v : _mm256_mul_ps(v, s); }

// 8 fp16 to float. The hardware converts every value as elem::f16_to_f32 does, except that it quiets
// a signaling NaN; the portable code keeps an Inf's or NaN's bits as they are, so those lanes are
// rebuilt from the bits (rare: the common case only tests for them).
DDP_SIMD inline __m256 f16_load(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 f = _mm256_cvtph_ps(h);
  const __m256i x = _mm256_cvtepu16_epi32(h), e = _mm256_set1_epi32(0x7c00);
  const __m256i special = _mm256_cmpeq_epi32(_mm256_and_si256(x, e), e);
  if (_mm256_testz_si256(special, special)) return f;
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x8000)), 16);
  const __m256i mant = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x3ff)), 13);
  const __m256i bits = _mm256_or_si256(_mm256_or_si256(sign, mant), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_ps(f, _mm256_castsi256_ps(bits), _mm256_castsi256_ps(special));
}

// 8 int32 lanes holding 16-bit values (0 .. 0xffff) to 8 uint16 in lane order.
DDP_SIMD inline __m128i narrow16(__m256i v) {
  return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

// 8 floats to fp16. The hardware's rounding (to nearest even, subnormals, overflow to Inf) is the
// portable one; a NaN keeps payload bits there, while elem::f32_to_f16 sends sign | 0x7e00 (a sum's
// NaN, `sum`: 0x7e00, elem::defined_nan).
DDP_SIMD inline void f16_store(uint16_t* p, __m256 v, bool sum = false) {
  __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  if (_mm256_movemask_ps(nan) != 0) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i sign =
        sum ? _mm256_setzero_si256() : _mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(INT32_MIN)), 16);
    const __m256i m = _mm256_castps_si256(nan);
    const __m128i m16 = _mm_packs_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_blendv_epi8(h, narrow16(_mm256_or_si256(sign, _mm256_set1_epi32(0x7e00))), m16);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}

DDP_SIMD inline __m256 bf16_load(const uint16_t* p) {
  const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}

// elem::f32_to_bf16 on 8 lanes, in the same integer steps: round the dropped half to nearest even,
// a NaN keeps its top bits with the quiet bit set (a sum's NaN, `sum`: 0x7fc0, elem::defined_nan).
DDP_SIMD inline void bf16_store(uint16_t* p, __m256 v, bool sum = false) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i rounding = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, rounding), 16);
  const __m256i quiet = sum ? _mm256_set1_epi32(0x7fc0) : _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow16(_mm256_blendv_epi8(r, quiet, nan)));
}

// The element types as 8-lane float vectors.
struct F32v {
  typedef float T;
  DDP_SIMD static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  DDP_SIMD static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};
struct F16v {
  typedef uint16_t T;
  DDP_SIMD static __m256 load(const uint16_t* p) { return f16_load(p); }
  DDP_SIMD static void store(uint16_t* p, __m256 v) { f16_store(p, v); }
  DDP_SIMD static void store_sum(uint16_t* p, __m256 v) { f16_store(p, v, true); }
};
struct BF16v {
  typedef uint16_t T;
  DDP_SIMD static __m256 load(const uint16_t* p) { return bf16_load(p); }
  DDP_SIMD static void store(uint16_t* p, __m256 v) { bf16_store(p, v); }
  DDP_SIMD static void store_sum(uint16_t* p, __m256 v) { bf16_store(p, v, true); }
};

// The last n % 8 elements go through the same vector code from a zero-padded copy, so that no
// element has a second (scalar) definition to keep in step.
template <class S, class D>
DDP_SIMD void cast(const typename S::T* in, typename D::T* out, size_t n, float scale, bool unit) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) D::store(out + i, scaled(S::load(in + i), s, unit));
  if (i == n) return;
  typename S::T t[8] = {};
  typename D::T o[8];
  std::memcpy(t, in + i, (n - i) * sizeof t[0]);
  D::store(o, scaled(S::load(t), s, unit));
  std::memcpy(out + i, o, (n - i) * sizeof o[0]);
}

// elem::sum_scaled: the sum, scaled, stored with a NaN made the default quiet NaN (store_sum).
// Both inputs are loaded before the store, so out may be a.
template <class V>
DDP_SIMD void sum(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n, float scale, bool unit) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) V::store_sum(out + i, scaled(_mm256_add_ps(V::load(a + i), V::load(b + i)), s, unit));
  if (i == n) return;
  uint16_t x[8] = {}, y[8] = {}, o[8];
  std::memcpy(x, a + i, (n - i) * 2);
  std::memcpy(y, b + i, (n - i) * 2);
  V::store_sum(o, scaled(_mm256_add_ps(V::load(x), V::load(y)), s, unit));
  std::memcpy(out + i, o, (n - i) * 2);
}

// One vector of quantize_block's first pass: kept in y, its NaNs and magnitudes folded into the lanes.
DDP_SIMD inline void absorb(float* y, __m256& lane_nan, __m256& lane_max, __m256 v) {
  _mm256_store_ps(y, v);
  lane_nan = _mm256_or_ps(lane_nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  lane_max = _mm256_max_ps(_mm256_and_ps(v, magnitude), lane_max);  // v > max ? v : max, as there
}

// elem::int8_quantize_block<F32>, 8 lanes at a time: its per-lane maxima are 8 wide too (its poison
// is checked otherwise, below), and the block is zero-padded to a multiple of 8 as there. Each step
// is the portable one: the same additions, the compare-selects written as max/min with the operands
// in the order that gives the same result, a division where the reciprocal overflows, products
// rounded before the sums. Whole vectors load plainly; only a block's tail takes masked loads.
DDP_SIMD void quantize_block(const float* x, float* residual, size_t n, float* scale, int8_t* q) {
  alignas(32) float y[elem::kInt8Block];
  const size_t padded = (n + 7) / 8 * 8;
  const __m256 zero = _mm256_setzero_ps();
  // The portable poison (a sum of y * 0) is NaN exactly when some y is a NaN or an Inf; an Inf also
  // makes the maximum, and so the scale, infinite. So a NaN seen here plus the scale's own check give
  // the same verdict, with one compare where the portable code multiplies and adds.
  __m256 lane_max = zero, lane_nan = zero;
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    absorb(y + i, lane_nan, lane_max, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(residual + i)));
  if (i < padded) {
    const __m256i live =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    absorb(y + i, lane_nan, lane_max,
           _mm256_add_ps(_mm256_maskload_ps(x + i, live), _mm256_maskload_ps(residual + i, live)));
  }
  alignas(32) float lm[8];
  _mm256_store_ps(lm, lane_max);
  float amax = 0;
  for (size_t k = 0; k < 8; ++k) amax = lm[k] > amax ? lm[k] : amax;
  const float s = amax / 127.0f;
  if (_mm256_movemask_ps(lane_nan) != 0 || s - s != 0.0f) {
    *scale = elem::bits_f32(0x7fc00000u);
    std::memset(q, 0, n);
    std::memset(residual, 0, n * 4);
    return;
  }
  *scale = s;
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  const bool divide = inv - inv != 0.0f;
  const __m256 step = _mm256_set1_ps(s), rcp = _mm256_set1_ps(inv), big = _mm256_set1_ps(12582912.0f);
  for (i = 0; i < padded; i += 8) {
    const __m256 v = _mm256_load_ps(y + i);
    const __m256 t = divide ? _mm256_div_ps(v, step) : _mm256_mul_ps(v, rcp);
    __m256 r = _mm256_sub_ps(_mm256_add_ps(t, big), big);  // elem::round_small
    r = _mm256_min_ps(_mm256_set1_ps(127.0f), r);          // r > 127 ? 127 : r
    r = _mm256_max_ps(_mm256_set1_ps(-127.0f), r);         // r < -127 ? -127 : r
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(_mm256_cvttps_epi32(r)),
                                      _mm256_extracti128_si256(_mm256_cvttps_epi32(r), 1));
    const __m256 left = _mm256_sub_ps(v, _mm256_mul_ps(r, step));
    if (i + 8 <= n) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w, w));
      _mm256_storeu_ps(residual + i, left);
      continue;
    }
    alignas(32) int8_t qt[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(qt), _mm_packs_epi16(w, w));
    std::memcpy(q + i, qt, n - i);
    const __m256i live =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(residual + i, live, left);
  }
}

}  // namespace

bool supported() {
  static const bool ok = [] {
    __builtin_cpu_init();  // may run before the library's constructors
    // F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c". The
    // AVX2 check includes the operating system's saving of the registers, which F16C uses too.
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
    return __builtin_cpu_supports("avx2") && f16c;
  }();
  return ok;
}

DDP_SIMD void f32_to_f16(const float* in, uint16_t* out, size_t n, float scale, bool unit) {
  cast<F32v, F16v>(in, out, n, scale, unit);
}
DDP_SIMD void f16_to_f32(const uint16_t* in, float* out, size_t n, float scale, bool unit) {
  cast<F16v, F32v>(in, out, n, scale, unit);
}
DDP_SIMD void f32_to_bf16(const float* in, uint16_t* out, size_t n, float scale, bool unit) {
  cast<F32v, BF16v>(in, out, n, scale, unit);
}
DDP_SIMD void bf16_to_f32(const uint16_t* in, float* out, size_t n, float scale, bool unit) {
  cast<BF16v, F32v>(in, out, n, scale, unit);
}
DDP_SIMD void sum_f16(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n, float scale, bool unit) {
  sum<F16v>(a, b, out, n, scale, unit);
}
DDP_SIMD void sum_bf16(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n, float scale, bool unit) {
  sum<BF16v>(a, b, out, n, scale, unit);
}

DDP_SIMD void int8_quantize_f32(const float* x, float* residual, size_t n, size_t lo, size_t len, char* chunk) {
  float* scales = reinterpret_cast<float*>(chunk) + lo / elem::kInt8Block;
  int8_t* q = reinterpret_cast<int8_t*>(chunk + elem::int8_blocks(n) * 4) + lo;
  for (size_t k = 0, at = 0; at < len; ++k, at += elem::kInt8Block)
    quantize_block(x + at, residual + at, std::min<size_t>(elem::kInt8Block, len - at), scales + k, q + at);
}

// Eight outputs at a time, each the sum over the ranks in rank order of q * scale, the product
// rounded before the sum (elem::int8_term); 8 divides the block size, so a vector has one scale. The
// last k < 8 values are read and written through copies.
static DDP_SIMD inline __m256 dequant8(const char* chunks, size_t chunk_bytes, int world, size_t q_at, size_t i,
                                       size_t k) {
  __m256 acc = _mm256_setzero_ps();
  for (int r = 0; r < world; ++r) {
    const char* c = chunks + static_cast<size_t>(r) * chunk_bytes;
    float s;
    std::memcpy(&s, c + i / elem::kInt8Block * 4, 4);
    int64_t bytes = 0;
    std::memcpy(&bytes, c + q_at + i, k);
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, _mm256_set1_ps(s)));
  }
  return acc;
}

DDP_SIMD void int8_dequant_sum_f32(const char* chunks, size_t chunk_bytes, int world, size_t n, size_t lo, size_t len,
                                   float* out) {
  const size_t q_at = elem::int8_blocks(n) * 4;
  size_t i = 0;
  for (; i + 8 <= len; i += 8) _mm256_storeu_ps(out + i, dequant8(chunks, chunk_bytes, world, q_at, lo + i, 8));
  if (i == len) return;
  alignas(32) float o[8];
  _mm256_store_ps(o, dequant8(chunks, chunk_bytes, world, q_at, lo + i, len - i));
  std::memcpy(out + i, o, (len - i) * 4);
}

}  // namespace simd
}  // namespace host
}  // namespace ddp

#else  // not x86-64: no SIMD path; host_kernels.cpp never calls these once supported() says no.

namespace ddp {
namespace host {
namespace simd {

bool supported() { return false; }

[[noreturn]] static void absent() { fail(DDP_ERR_INTERNAL, "the host SIMD loops are not built for this CPU"); }
void f32_to_f16(const float*, uint16_t*, size_t, float, bool) { absent(); }
void f16_to_f32(const uint16_t*, float*, size_t, float, bool) { absent(); }
void f32_to_bf16(const float*, uint16_t*, size_t, float, bool) { absent(); }
void bf16_to_f32(const uint16_t*, float*, size_t, float, bool) { absent(); }
void sum_f16(const uint16_t*, const uint16_t*, uint16_t*, size_t, float, bool) { absent(); }
void sum_bf16(const uint16_t*, const uint16_t*, uint16_t*, size_t, float, bool) { absent(); }
void int8_quantize_f32(const float*, float*, size_t, size_t, size_t, char*) { absent(); }
void int8_dequant_sum_f32(const char*, size_t, int, size_t, size_t, size_t, float*) { absent(); }

}  // namespace simd
}  // namespace host
}  // namespace ddp

#endif
