// The host element loops: cast, scale and scan host memory. The same per-element operations as the
// CUDA kernels (kernels/elementwise.h); this file is built with vectorization on (see the Makefile).
#include "host/host_kernels.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>

#include "core/knobs.hpp"
#include "host/host_simd.hpp"
#include "kernels/elementwise.h"
#include "kernels/kernel_bodies.h"

namespace ddp {

namespace host {

// -1 until the first call decides: the CPU check and the knob are read once, not per bucket.
static std::atomic<int> g_simd{-1};

bool simd_path() {
  int on = g_simd.load(std::memory_order_relaxed);
  if (on < 0) {
    on = knobs::host_simd() && simd::supported() ? 1 : 0;
    g_simd.store(on, std::memory_order_relaxed);
  }
  return on == 1;
}

void choose_simd_path_again() { g_simd.store(-1, std::memory_order_relaxed); }

template <class A, class B>
constexpr bool same() {
  return std::is_same<A, B>::value;
}

// The f32 <-> fp16 / bf16 casts on the SIMD path, when it is taken (true); false leaves the element
// to the portable loop. The scale is applied in float, as elem::scaled_cast does for these pairs.
template <class S, class D>
static bool simd_cast(const void* src, void* dst, size_t n, double scale) {
  constexpr bool from32 = same<S, elem::F32>(), to32 = same<D, elem::F32>();
  constexpr bool half = same<S, elem::F16>() || same<D, elem::F16>();
  constexpr bool brain = same<S, elem::BF16>() || same<D, elem::BF16>();
  if constexpr ((from32 || to32) && (half || brain)) {
    if (!simd_path()) return false;
    const float f = static_cast<float>(scale);
    const bool unit = scale == 1.0;
    const float* f32 = static_cast<const float*>(from32 ? src : nullptr);
    const uint16_t* h = static_cast<const uint16_t*>(from32 ? nullptr : src);
    if (from32)
      (half ? simd::f32_to_f16 : simd::f32_to_bf16)(f32, static_cast<uint16_t*>(dst), n, f, unit);
    else
      (half ? simd::f16_to_f32 : simd::bf16_to_f32)(h, static_cast<float*>(dst), n, f, unit);
    return true;
  }
  return false;
}

template <class S, class D>
static void convert_typed(const void* src, void* dst, size_t n, double scale) {
  if constexpr (std::is_same<S, D>::value && std::is_same<typename S::storage, typename S::math>::value) {
    // f32 -> f32 and f64 -> f64 scaling (the averaging pass, and the unpack that folds it in): the same
    // single multiply in the type's own precision as scaled_cast, written as plain loops that the
    // compiler vectorizes. The generic loop below, with its per-element branch and possible aliasing,
    // stays scalar.
    typedef typename S::storage T;
    const T s = static_cast<T>(scale);
    if (src == dst) {
      T* p = static_cast<T*>(dst);
      for (size_t i = 0; i < n; ++i) p[i] *= s;
      return;
    }
    const T* __restrict in = static_cast<const T*>(src);  // pack and unpack buffers never overlap
    T* __restrict out = static_cast<T*>(dst);
    for (size_t i = 0; i < n; ++i) out[i] = in[i] * s;
    return;
  }
  if (simd_cast<S, D>(src, dst, n, scale)) return;
  const typename S::storage* in = static_cast<const typename S::storage*>(src);
  typename D::storage* out = static_cast<typename D::storage*>(dst);
  const bool unit = scale == 1.0;
  for (size_t i = 0; i < n; ++i) out[i] = elem::scaled_cast<S, D>(in[i], scale, unit);
}

template <class S>
static void convert_from(const void* src, void* dst, Dtype d, size_t n, double scale) {
  switch (d) {
    case Dtype::F16: return convert_typed<S, elem::F16>(src, dst, n, scale);
    case Dtype::BF16: return convert_typed<S, elem::BF16>(src, dst, n, scale);
    case Dtype::F32: return convert_typed<S, elem::F32>(src, dst, n, scale);
    case Dtype::F64: return convert_typed<S, elem::F64>(src, dst, n, scale);
  }
}

void convert(const void* src, Dtype s, void* dst, Dtype d, size_t n, double scale) {
  if (n == 0) return;
  if (s == d && scale == 1.0) {
    if (src != dst) std::memmove(dst, src, n * dtype_size(d));
    return;
  }
  switch (s) {
    case Dtype::F16: return convert_from<elem::F16>(src, dst, d, n, scale);
    case Dtype::BF16: return convert_from<elem::BF16>(src, dst, d, n, scale);
    case Dtype::F32: return convert_from<elem::F32>(src, dst, d, n, scale);
    case Dtype::F64: return convert_from<elem::F64>(src, dst, d, n, scale);
  }
}

template <class T>
static void sum_scaled_typed(const void* a, const void* b, void* out, size_t n, double scale) {
  typedef typename T::storage S;
  const typename T::math f = static_cast<typename T::math>(scale);
  const bool unit = scale == 1.0;
  if constexpr (same<T, elem::F16>() || same<T, elem::BF16>()) {
    if (simd_path())
      return (same<T, elem::F16>() ? simd::sum_f16 : simd::sum_bf16)(
          static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), static_cast<uint16_t*>(out), n, f, unit);
  }
  const S* __restrict y = static_cast<const S*>(b);
  S* o = static_cast<S*>(out);
  // Separate loops for the in-place case and for each scale so that each one vectorizes.
  if (a == out) {
    if (unit)
      for (size_t i = 0; i < n; ++i) o[i] = elem::sum_scaled<T>(o[i], y[i], f, true);
    else
      for (size_t i = 0; i < n; ++i) o[i] = elem::sum_scaled<T>(o[i], y[i], f, false);
    return;
  }
  const S* __restrict x = static_cast<const S*>(a);
  S* __restrict w = o;
  if (unit)
    for (size_t i = 0; i < n; ++i) w[i] = elem::sum_scaled<T>(x[i], y[i], f, true);
  else
    for (size_t i = 0; i < n; ++i) w[i] = elem::sum_scaled<T>(x[i], y[i], f, false);
}

void sum_scaled(const void* a, const void* b, void* out, size_t n, Dtype d, double scale) {
  switch (d) {
    case Dtype::F16: return sum_scaled_typed<elem::F16>(a, b, out, n, scale);
    case Dtype::BF16: return sum_scaled_typed<elem::BF16>(a, b, out, n, scale);
    case Dtype::F32: return sum_scaled_typed<elem::F32>(a, b, out, n, scale);
    case Dtype::F64: return sum_scaled_typed<elem::F64>(a, b, out, n, scale);
  }
}

// In blocks that stay in L1, through the casts and sums above (so the bits are theirs, on the SIMD
// and the portable path alike).
void add_widened(const float* a, const void* b, Dtype wire, float* out, size_t n, double scale, void* bits) {
  constexpr size_t kBlock = 2048;
  float tmp[kBlock];
  const size_t ws = dtype_size(wire);
  for (size_t lo = 0; lo < n; lo += kBlock) {
    const size_t k = std::min(kBlock, n - lo);
    convert(static_cast<const char*>(b) + lo * ws, wire, tmp, Dtype::F32, k, 1.0);
    sum_scaled(a + lo, tmp, out + lo, k, Dtype::F32, scale);
    if (bits) {
      char* w = static_cast<char*>(bits) + lo * ws;
      convert(out + lo, Dtype::F32, w, wire, k, 1.0);
      convert(w, wire, out + lo, Dtype::F32, k, 1.0);
    }
  }
}

void round_through(const float* in, float* out, size_t n, Dtype wire, double scale) {
  constexpr size_t kBlock = 2048;
  uint16_t tmp[kBlock];
  for (size_t lo = 0; lo < n; lo += kBlock) {
    const size_t k = std::min(kBlock, n - lo);
    convert(in + lo, Dtype::F32, tmp, wire, k, scale);
    convert(tmp, wire, out + lo, Dtype::F32, k, 1.0);
  }
}

// The whole chunk: one "thread" over every block, the GPU kernel's body (kern::int8_quantize_thread)
// run on the host. A span of it: the same element code (elem::int8_quantize_block) block by block.
template <class T>
static void int8_quantize_typed(const void* x, size_t n, size_t lo, size_t len, float* residual, void* chunk) {
  typedef typename T::storage S;
  if (lo == 0 && len == n)
    return kern::int8_quantize_thread<T>(static_cast<const S*>(x), residual, n, static_cast<char*>(chunk), 0, 0, 1, 1);
  float* scales = reinterpret_cast<float*>(chunk) + lo / elem::kInt8Block;
  int8_t* q = reinterpret_cast<int8_t*>(static_cast<char*>(chunk) + elem::int8_blocks(n) * 4) + lo;
  for (size_t k = 0, at = 0; at < len; ++k, at += elem::kInt8Block)
    elem::int8_quantize_block<T>(static_cast<const S*>(x) + at, residual + at,
                                 std::min<size_t>(elem::kInt8Block, len - at), scales + k, q + at);
}

void int8_quantize_span(const void* x, Dtype d, size_t n, size_t lo, size_t len, float* residual, void* chunk) {
  if (lo % elem::kInt8Block != 0 || lo + len > n || (lo + len < n && len % elem::kInt8Block != 0))
    fail(DDP_ERR_INTERNAL, "int8 span [%zu, %zu) of %zu elements is not whole blocks", lo, lo + len, n);
  if (d == Dtype::F64)
    int8_quantize_typed<elem::F64>(x, n, lo, len, residual, chunk);
  else if (d == Dtype::F32 && simd_path())
    simd::int8_quantize_f32(static_cast<const float*>(x), residual, n, lo, len, static_cast<char*>(chunk));
  else if (d == Dtype::F32)
    int8_quantize_typed<elem::F32>(x, n, lo, len, residual, chunk);
  else
    fail(DDP_ERR_INTERNAL, "the int8 wire takes f32 or f64 buckets, not %s", dtype_name(d));
}

void int8_quantize(const void* x, Dtype d, size_t n, float* residual, void* chunk) {
  int8_quantize_span(x, d, n, 0, n, residual, chunk);
}

// Block by block, rank after rank: each rank's term is added to the whole block in turn, so the
// inner loop is a plain multiply-add over contiguous values.
template <class T>
static void int8_dequant_sum_typed(const void* chunks, size_t chunk_bytes, int world, size_t n, size_t first,
                                   size_t len, void* out) {
  typedef typename T::math M;
  const char* base = static_cast<const char*>(chunks);
  const size_t q_at = elem::int8_blocks(n) * 4;
  typename T::storage* o = static_cast<typename T::storage*>(out);
  M acc[elem::kInt8Block];
  for (size_t at = 0; at < len; at += elem::kInt8Block) {
    const size_t k = std::min<size_t>(elem::kInt8Block, len - at), lo = first + at;
    for (size_t i = 0; i < k; ++i) acc[i] = M(0);
    for (int r = 0; r < world; ++r) {
      const char* c = base + static_cast<size_t>(r) * chunk_bytes;
      float scale;
      std::memcpy(&scale, c + lo / elem::kInt8Block * 4, 4);
      const int8_t* q = reinterpret_cast<const int8_t*>(c + q_at) + lo;
      for (size_t i = 0; i < k; ++i) acc[i] = elem::int8_term<T>(acc[i], q[i], scale);
    }
    for (size_t i = 0; i < k; ++i) o[at + i] = T::store(acc[i]);
  }
}

void int8_dequant_sum_span(const void* chunks, size_t chunk_bytes, int world, size_t n, size_t lo, size_t len, Dtype d,
                           void* out) {
  if (lo % elem::kInt8Block != 0 || lo + len > n)
    fail(DDP_ERR_INTERNAL, "int8 span [%zu, %zu) of %zu elements does not start a block", lo, lo + len, n);
  if (d == Dtype::F64)
    int8_dequant_sum_typed<elem::F64>(chunks, chunk_bytes, world, n, lo, len, out);
  else if (d == Dtype::F32 && simd_path())
    simd::int8_dequant_sum_f32(static_cast<const char*>(chunks), chunk_bytes, world, n, lo, len,
                               static_cast<float*>(out));
  else if (d == Dtype::F32)
    int8_dequant_sum_typed<elem::F32>(chunks, chunk_bytes, world, n, lo, len, out);
  else
    fail(DDP_ERR_INTERNAL, "the int8 wire takes f32 or f64 buckets, not %s", dtype_name(d));
}

void int8_dequant_sum(const void* chunks, size_t chunk_bytes, int world, size_t n, Dtype d, void* out) {
  int8_dequant_sum_span(chunks, chunk_bytes, world, n, 0, n, d, out);
}

template <class T>
static bool nonfinite_typed(const void* buf, size_t n) {
  const typename T::storage* p = static_cast<const typename T::storage*>(buf);
  bool bad = false;
  for (size_t i = 0; i < n; ++i) bad |= elem::is_nonfinite<T>(p[i]);
  return bad;
}

bool has_nonfinite(const void* buf, size_t n, Dtype d) {
  switch (d) {
    case Dtype::F16: return nonfinite_typed<elem::F16>(buf, n);
    case Dtype::BF16: return nonfinite_typed<elem::BF16>(buf, n);
    case Dtype::F32: return nonfinite_typed<elem::F32>(buf, n);
    case Dtype::F64: return nonfinite_typed<elem::F64>(buf, n);
  }
  return false;
}

}  // namespace host

}  // namespace ddp
