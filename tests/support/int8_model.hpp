// A float64 model of the int8 wire (DDP_COMPRESS_INT8), for the tests that compare the library's
// results with it bit for bit: the same quantization, done in double, rounding to fp32 after every
// operation of an f32 bucket (one +, -, * or / of floats computed in double and rounded to float is
// the float result). Blocks of 256 elements from the bucket's start; scale = fp32(max |y| / 127) for
// y = x + kept error; q = round-half-even(y * (1 / scale)), clamped to 127 (a scale with no finite
// fp32 reciprocal divides instead); kept error = y - q * scale; the sum adds q * scale rank after
// rank. The reduce-scatter cuts the bucket into `world` shards of whole blocks, shard j from block
// floor(blocks * j / world); its owner re-quantizes the sum with kept errors of its own, and every
// rank takes the dequantized result. A block with a NaN, an Inf or a magnitude past the fp32 range
// (f64 buckets) in what is quantized (a rank's input, or a shard's sum) is NaN, its errors dropped.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <vector>

namespace int8_model {

struct Int8Quant {
  double scale = 0;
  std::vector<int> q;
};

// One block of y = x + residual in the bucket type's math (f32: every step rounded to float).
inline Int8Quant model_quantize(const double* x, double* residual, size_t n, bool f32) {
  auto r32 = [f32](double v) { return f32 ? static_cast<double>(static_cast<float>(v)) : v; };
  std::vector<double> y(n);
  double amax = 0;
  for (size_t i = 0; i < n; ++i) {
    y[i] = r32(x[i] + residual[i]);
    amax = std::isnan(y[i]) ? y[i] : std::max(amax, std::fabs(y[i]));
  }
  Int8Quant out;
  out.q.assign(n, 0);
  // A NaN, an Inf or a magnitude past the fp32 range: the block travels as a NaN scale, its kept
  // errors dropped.
  if (!(amax <= static_cast<double>(FLT_MAX))) {
    out.scale = std::nan("");
    for (size_t i = 0; i < n; ++i) residual[i] = 0.0;
    return out;
  }
  const double s = static_cast<float>(r32(amax / 127.0));
  out.scale = s;
  const double inv = s > 0 ? r32(1.0 / s) : 0.0;
  const bool divide = std::isinf(inv);
  for (size_t i = 0; i < n; ++i) {
    double r = std::nearbyint(divide ? r32(y[i] / s) : r32(y[i] * inv));
    r = std::min(127.0, std::max(-127.0, r));
    out.q[i] = static_cast<int>(r);
    residual[i] = static_cast<float>(r32(y[i] - r32(r * s)));
  }
  return out;
}

// A bucket's int8 reduction over `world` ranks' inputs xs[r] (already in the bucket's type), with the
// kept errors res[r] (per rank, the bucket's length) and, scattering, shard[j] (rank j's shard).
inline std::vector<double> model_int8(const std::vector<std::vector<double>>& xs, std::vector<std::vector<double>>& res,
                                      std::vector<std::vector<double>>& shard, bool scatter, bool f32) {
  auto r32 = [f32](double v) { return f32 ? static_cast<double>(static_cast<float>(v)) : v; };
  const size_t n = xs[0].size(), world = xs.size(), blocks = (n + 255) / 256;
  std::vector<double> sum(n, 0.0);
  for (size_t r = 0; r < world; ++r)  // the first quantization is the same in both designs
    for (size_t lo = 0; lo < n; lo += 256) {
      const size_t m = std::min<size_t>(256, n - lo);
      const Int8Quant b = model_quantize(&xs[r][lo], &res[r][lo], m, f32);
      for (size_t i = 0; i < m; ++i) sum[lo + i] = r32(sum[lo + i] + r32(b.q[i] * b.scale));
    }
  if (!scatter) return sum;
  std::vector<double> out(n, 0.0);
  for (size_t j = 0; j < world; ++j) {
    const size_t lo = std::min(n, blocks * j / world * 256), hi = std::min(n, blocks * (j + 1) / world * 256);
    shard[j].resize(hi - lo, 0.0);
    for (size_t b = lo; b < hi; b += 256) {
      const size_t m = std::min<size_t>(256, hi - b);
      const Int8Quant q = model_quantize(&sum[b], &shard[j][b - lo], m, f32);
      for (size_t i = 0; i < m; ++i) out[b + i] = r32(0.0 + r32(q.q[i] * q.scale));
    }
  }
  return out;
}

// A rank's chunk of m elements: a 4-byte scale per block, then the values, padded to 8 bytes.
inline size_t chunk_bytes(size_t m) { return ((m + 255) / 256 * 4 + m + 7) / 8 * 8; }

// Whether a bucket of n elements goes through the reduce-scatter on a host comm of `world` ranks
// with DDP_INT8_SCATTER_MIN_WORLD = min_world: from that size on, and from 3 ranks only where its
// largest shard's chunk, sent twice, is smaller than the whole chunk the all-gather sends.
inline bool scatters(size_t n, int world, int min_world) {
  const size_t blocks = (n + 255) / 256, w = static_cast<size_t>(world);
  size_t most = 0;
  for (size_t j = 0; j < w; ++j)
    most = std::max(most, std::min(n, blocks * (j + 1) / w * 256) - std::min(n, blocks * j / w * 256));
  return world >= min_world && (world < 3 || 2 * chunk_bytes(most) < chunk_bytes(n));
}

}  // namespace int8_model
