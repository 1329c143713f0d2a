// The int8 wire's error bound exactly as include/ddp.h states it (DDP_COMPRESS_INT8), in float64,
// from the ranks' inputs alone: no model of the quantization, only the header's formula.
//
//   m_r(t) = a_r(t) + e_r(t-1),  e_r(t) = k m_r(t) + 2^-142,  e_r(-1) = 0,  k = (1 + 2^-10) / 254
//   |S - sum_r x_r| <= sum_r (e_r(t) + e_r(t-1)) + 2 (W + 1) u sum_r m_r(t)
//     reduce-scatter, plus E(t) + E(t-1) + 2 u M(t),
//     M(t) = (1 + 2^-10) sum_r m_r(t) + E(t-1),  E(t) = k M(t) + 2^-142,  E(-1) = 0
//
// a_r(t) is the largest |x_r| of the element's block (256 elements from the bucket's start) on rank
// r; u = 2^-24 for f32 buckets, 2^-53 for f64. One Int8Bound per bucket, fed every reduction.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace int8_bound {

const double kSlack = 1.0 + std::ldexp(1.0, -10);
const double kK = kSlack / 254.0;
const double kFloor = std::ldexp(1.0, -142);

class Int8Bound {
 public:
  // A bucket of n elements over `world` ranks, f32 or f64, reduced by the reduce-scatter or not.
  Int8Bound(size_t n, int world, bool f32, bool scatter)
      : n_(n),
        world_(world),
        u_(f32 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -53)),
        scatter_(scatter),
        e_(static_cast<size_t>(world), std::vector<double>(blocks(), 0.0)),
        E_(blocks(), 0.0) {}

  size_t blocks() const { return (n_ + 255) / 256; }

  // One reduction: xs[r][i] is rank r's value of element i (after pre-division). Returns, per
  // element, the bound on |S - sum_r x_r|, and carries e_r and E on to the next reduction.
  std::vector<double> step(const std::vector<std::vector<double>>& xs) {
    std::vector<double> bound(n_, 0.0);
    for (size_t b = 0; b < blocks(); ++b) {
      const size_t lo = b * 256, hi = std::min(n_, lo + 256);
      double sum_m = 0, sum_e = 0;
      for (int r = 0; r < world_; ++r) {
        double a = 0;
        for (size_t i = lo; i < hi; ++i) a = std::max(a, std::fabs(xs[static_cast<size_t>(r)][i]));
        double& e = e_[static_cast<size_t>(r)][b];
        const double m = a + e, now = kK * m + kFloor;
        sum_m += m;
        sum_e += now + e;
        e = now;
      }
      double total = sum_e + 2.0 * (world_ + 1) * u_ * sum_m;
      if (scatter_) {
        const double M = kSlack * sum_m + E_[b], now = kK * M + kFloor;
        total += now + E_[b] + 2.0 * u_ * M;
        E_[b] = now;
      }
      for (size_t i = lo; i < hi; ++i) bound[i] = total;
    }
    return bound;
  }

 private:
  size_t n_;
  int world_;
  double u_;
  bool scatter_;
  std::vector<std::vector<double>> e_;  // per rank, per block: e_r(t-1)
  std::vector<double> E_;               // per block: E(t-1)
};

}  // namespace int8_bound
