// Element operations shared by the host backend and the CUDA kernels: 16-bit conversions (round to
// nearest even, NaN kept quiet, overflow to infinity) and the scaled cast every pack/unpack applies.
// Written once as __host__ __device__ code so that the host unit tests cover what the GPU runs.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define DDP_HD __host__ __device__ __forceinline__
#else
#define DDP_HD inline
#endif

// DDP_ELEM_CONTRACTS: defined by a translation unit compiled with floating-point contraction on
// (-ffp-contract=fast on an FMA target), as nvcc compiles the kernels: the simulated kernels of
// tests/gpusim and a unit test. There mul_rn/add_rn keep their rounding as __fmul_rn/__fadd_rn do on
// the GPU, and every element function has internal linkage, so that the linker never merges that
// unit's copies with the host library's (compiled with contraction off) into one.
namespace ddp {
namespace elem {
#if defined(DDP_ELEM_CONTRACTS)
namespace {
#endif

// A product and a sum, each rounded on its own, on the host and the GPU alike. nvcc contracts
// a * b + c into one FMA (one rounding) by default, and GCC does too on an FMA target
// (-ffp-contract=fast is its default for C++), so element code whose bits the host and the GPU must
// share writes such expressions with these: __fmul_rn/__fadd_rn are never contracted on the GPU;
// on the host the element loops are compiled with -ffp-contract=off (see the Makefile), and a
// unit that contracts stores the product through a volatile, which no compiler can fuse.
#if defined(__CUDA_ARCH__)
#define DDP_ELEM_RN(op, device_fn) return device_fn(a, b)
#elif defined(DDP_ELEM_CONTRACTS)
#define DDP_ELEM_RN(op, device_fn) \
  volatile decltype(a) r = a op b; \
  return r
#else
#define DDP_ELEM_RN(op, device_fn) return a op b
#endif
DDP_HD float mul_rn(float a, float b) { DDP_ELEM_RN(*, __fmul_rn); }
DDP_HD double mul_rn(double a, double b) { DDP_ELEM_RN(*, __dmul_rn); }
DDP_HD float add_rn(float a, float b) { DDP_ELEM_RN(+, __fadd_rn); }
DDP_HD double add_rn(double a, double b) { DDP_ELEM_RN(+, __dadd_rn); }
#undef DDP_ELEM_RN

DDP_HD uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
DDP_HD float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// bfloat16 is the top half of a float: round the dropped 16 bits to nearest even.
DDP_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}
DDP_HD float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
DDP_HD uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // Result is subnormal (or zero): value = a * 2^24 in units of the smallest subnormal 2^-24.
    if (a < 0x33000000u) return sign;  // below half the smallest subnormal: zero
    uint32_t exp = a >> 23;            // biased f32 exponent, 102..112
    uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exp;  // so that mant >> shift is the subnormal count
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even.
  uint32_t r = a - 0x38000000u;  // (127-15) << 23
  uint32_t rounding = 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((r + rounding) >> 13));
}

DDP_HD float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    if (mant == 0) return bits_f32(sign);
    // Subnormal: mant * 2^-24, exact in f32.
    float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return (sign != 0u) ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Typed load/store through the storage type of each dtype; arithmetic in float (16/32-bit) or double.
struct F16 {
  typedef uint16_t storage;
  typedef float math;
  static DDP_HD math load(storage v) { return f16_to_f32(v); }
  static DDP_HD storage store(math v) { return f32_to_f16(v); }
};
struct BF16 {
  typedef uint16_t storage;
  typedef float math;
  static DDP_HD math load(storage v) { return bf16_to_f32(v); }
  static DDP_HD storage store(math v) { return f32_to_bf16(v); }
};
struct F32 {
  typedef float storage;
  typedef float math;
  static DDP_HD math load(storage v) { return v; }
  static DDP_HD storage store(math v) { return v; }
};
struct F64 {
  typedef double storage;
  typedef double math;
  static DDP_HD math load(storage v) { return v; }
  static DDP_HD storage store(math v) { return v; }
};

// out = Dst(In * scale) with one rounding to Dst. A scale of exactly 1 skips the multiply so that a
// plain cast is bit-exact. The multiply happens in the wider of the two math types.
template <class Src, class Dst>
DDP_HD typename Dst::storage scaled_cast(typename Src::storage in, double scale, bool unit) {
  if (sizeof(typename Src::math) == 8 || sizeof(typename Dst::math) == 8) {
    double v = static_cast<double>(Src::load(in));
    if (!unit) v *= scale;
    return Dst::store(static_cast<typename Dst::math>(v));
  }
  float v = static_cast<float>(Src::load(in));
  if (!unit) v *= static_cast<float>(scale);
  return Dst::store(static_cast<typename Dst::math>(v));
}

// A NaN sum of 16-bit values is the positive default quiet NaN: which of two NaN operands an addition
// propagates is the compiler's (operand order) and the hardware's choice, so the host's portable and
// vector loops and a GPU would otherwise store different NaN bits. Wider sums keep what they get.
DDP_HD float defined_nan(float v, uint16_t) { return v == v ? v : bits_f32(0x7fc00000u); }
DDP_HD float defined_nan(float v, float) { return v; }
DDP_HD double defined_nan(double v, double) { return v; }

// out = T((a + b) * scale): the sum of two partial sums, then (unless `unit`) the averaging factor,
// each rounded in T's math type: bit for bit a sum followed by a separate scaling pass.
template <class T>
DDP_HD typename T::storage sum_scaled(typename T::storage a, typename T::storage b, typename T::math scale, bool unit) {
  typename T::math v = T::load(a) + T::load(b);
  if (!unit) v *= scale;
  return T::store(defined_nan(v, typename T::storage()));
}

template <class T>
DDP_HD bool is_nonfinite(typename T::storage v) {
  typename T::math m = T::load(v);
  return !(m - m == m - m);  // NaN for inf and NaN inputs
}

// --- The int8 wire (DDP_COMPRESS_INT8): blocks of kInt8Block elements, each sent as one fp32 scale
// and kInt8Block int8 values. A rank's chunk of a bucket of n elements holds every block's scale
// first, then the n values, padded to 8 bytes.
constexpr unsigned kInt8Block = 256;
// The largest finite fp32 value (FLT_MAX), spelled out so that device code needs no <cfloat>.
constexpr double kMaxF32 = 3.4028234663852886e38;

DDP_HD size_t int8_blocks(size_t n) { return (n + kInt8Block - 1) / kInt8Block; }
DDP_HD size_t int8_chunk_bytes(size_t n) { return (int8_blocks(n) * 4 + n + 7) / 8 * 8; }

// Round to nearest even for |v| < 2^22 (floats) or 2^51 (doubles), by adding and taking away
// 1.5 * 2^23 (2^52): plain arithmetic that vectorizes on every ISA (rint needs SSE4.1 to do so).
DDP_HD float round_small(float v) { return (v + 12582912.0f) - 12582912.0f; }
DDP_HD double round_small(double v) { return (v + 6755399441055744.0) - 6755399441055744.0; }

// Quantizes one block of n <= kInt8Block elements with error feedback: y = x + residual is sent as
// q * scale, q = round(y / scale) in -127..127, scale = max |y| / 127, and the residual becomes
// y - q * scale (what this rank still owes). A block with a NaN or Inf (or an f64 magnitude past
// the fp32 range, > kMaxF32) is sent with a NaN scale, so that it arrives as NaN everywhere, and its residual
// is dropped. Branch-free loops over a block held in registers or L1, so that they vectorize.
template <class T>
DDP_HD void int8_quantize_block(const typename T::storage* x, float* residual, size_t n, float* scale, int8_t* q) {
  typedef typename T::math M;
  M y[kInt8Block];
  // Per-lane maxima and poison (0, or NaN once some y is an Inf or a NaN: Inf * 0 is NaN), so that
  // the reductions vectorize without reassociating anything; lanes are combined at the end.
  const size_t L = 8;
  M lane_max[L], lane_poison[L];
  for (size_t k = 0; k < L; ++k) lane_max[k] = lane_poison[k] = M(0);
  for (size_t i = 0; i < n; ++i) y[i] = T::load(x[i]) + static_cast<M>(residual[i]);
  for (size_t i = n; i < (n + L - 1) / L * L; ++i) y[i] = M(0);
  for (size_t i = 0; i < n; i += L)
    for (size_t k = 0; k < L; ++k) {
      const M v = y[i + k], a = v < M(0) ? -v : v;
      lane_poison[k] += mul_rn(v, M(0));
      lane_max[k] = a > lane_max[k] ? a : lane_max[k];
    }
  M amax = 0, poison = 0;
  for (size_t k = 0; k < L; ++k) {
    poison += lane_poison[k];
    amax = lane_max[k] > amax ? lane_max[k] : amax;
  }
  // A magnitude past the fp32 range (an f64 block's; an f32 one past it is an Inf) cannot travel as
  // q * an fp32 scale: its scale may still be finite (max / 127 fits up to ~4.3e40), and the block
  // would come back finite and wrong. Such a block is poisoned like one holding an Inf.
  const float s = static_cast<float>(amax / M(127));
  if (poison != M(0) || !(amax <= static_cast<M>(kMaxF32)) || s - s != 0.0f) {
    *scale = bits_f32(0x7fc00000u);  // a quiet NaN
    for (size_t i = 0; i < n; ++i) {
      q[i] = 0;
      residual[i] = 0.0f;
    }
    return;
  }
  *scale = s;
  const M step = static_cast<M>(s), inv = s > 0.0f ? M(1) / step : M(0);
  // A scale below 1 / FLT_MAX (a block max below ~3.7e-37) has no finite fp32 reciprocal: such a
  // block divides instead (|y| / step <= 127, so nothing overflows; zeros stay zeros, not Inf * 0).
  const bool divide = inv - inv != M(0);
  for (size_t i = 0; i < n; ++i) {
    // Fused with round_small's + 1.5 * 2^23, the product would round once: mul_rn keeps it apart.
    M r = round_small(divide ? y[i] / step : mul_rn(y[i], inv));
    r = r > M(127) ? M(127) : r;
    r = r < M(-127) ? M(-127) : r;
    q[i] = static_cast<int8_t>(static_cast<int>(r));
    residual[i] = static_cast<float>(y[i] - mul_rn(r, step));
  }
}

// acc + q * scale in T's math type, the product and the sum each rounded: one rank's term of the
// dequantized sum.
template <class T>
DDP_HD typename T::math int8_term(typename T::math acc, int8_t q, float scale) {
  typedef typename T::math M;
  return add_rn(acc, mul_rn(static_cast<M>(q), static_cast<M>(scale)));
}

#if defined(DDP_ELEM_CONTRACTS)
}  // namespace
#endif
}  // namespace elem
}  // namespace ddp
