// Helpers of the GPU tests: the skip rule, one check macro for CUDA calls, typed host <-> device
// transfers and a float64 reference.
#pragma once

#include <cuda_runtime_api.h>
#include <doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/elementwise.h"
#include "ddp.h"

namespace gt {

// Whether a CUDA device is visible; the first call prints the one skip line when none is.
inline bool gpu_available() {
  static int state = -1;
  if (state < 0) {
    int n = 0;
    cudaError_t rc = cudaGetDeviceCount(&n);
    state = rc == cudaSuccess && n > 0;
    if (!state) {
      std::printf("gpu: skipped: no CUDA device is visible (cudaGetDeviceCount: %s, %d devices)\n",
                  rc == cudaSuccess ? "success" : cudaGetErrorName(rc), n);
      cudaGetLastError();
    }
  }
  return state == 1;
}

#define GPU_TEST_CASE(name) TEST_CASE(name* doctest::skip(!::gt::gpu_available()))

#define CUDA_OK(call)                                                                \
  do {                                                                               \
    cudaError_t gt_rc_ = (call);                                                     \
    REQUIRE_MESSAGE(gt_rc_ == cudaSuccess, #call, ": ", cudaGetErrorString(gt_rc_)); \
  } while (0)

#define DDP_OK(call)                                                                    \
  do {                                                                                  \
    ddp_status_t gt_st_ = (call);                                                       \
    REQUIRE_MESSAGE(gt_st_ == DDP_SUCCESS, #call, ": ", std::string(ddp_last_error())); \
  } while (0)

inline unsigned seed() {
  static unsigned s = 0;
  if (!s) {
    const char* e = std::getenv("DDP_TEST_SEED");
    s = e ? static_cast<unsigned>(std::strtoul(e, nullptr, 10)) : static_cast<unsigned>(std::random_device{}());
    if (!s) s = 1;
    std::printf("gpu tests: seed %u (set DDP_TEST_SEED to repeat)\n", s);
  }
  return s;
}

inline size_t dsize(ddp_dtype_t d) { return d == DDP_F64 ? 8 : d == DDP_F32 ? 4 : 2; }
inline const char* dname(ddp_dtype_t d) {
  static const char* n[] = {"f16", "bf16", "f32", "f64"};
  return n[d];
}

// Host bytes of dtype d from doubles (rounded once to d), and back (exact).
inline std::vector<char> encode(const std::vector<double>& v, ddp_dtype_t d) {
  using namespace ddp::elem;
  std::vector<char> out(v.size() * dsize(d));
  for (size_t i = 0; i < v.size(); ++i) {
    char* p = out.data() + i * dsize(d);
    if (d == DDP_F64) {
      std::memcpy(p, &v[i], 8);
    } else if (d == DDP_F32) {
      float f = static_cast<float>(v[i]);
      std::memcpy(p, &f, 4);
    } else {
      uint16_t h = d == DDP_F16 ? f32_to_f16(static_cast<float>(v[i])) : f32_to_bf16(static_cast<float>(v[i]));
      std::memcpy(p, &h, 2);
    }
  }
  return out;
}

inline std::vector<double> decode(const std::vector<char>& b, ddp_dtype_t d) {
  using namespace ddp::elem;
  std::vector<double> out(b.size() / dsize(d));
  for (size_t i = 0; i < out.size(); ++i) {
    const char* p = b.data() + i * dsize(d);
    if (d == DDP_F64) {
      std::memcpy(&out[i], p, 8);
    } else if (d == DDP_F32) {
      float f;
      std::memcpy(&f, p, 4);
      out[i] = f;
    } else {
      uint16_t h;
      std::memcpy(&h, p, 2);
      out[i] = d == DDP_F16 ? f16_to_f32(h) : bf16_to_f32(h);
    }
  }
  return out;
}

// Values in [-2, 2), rounded to d, so that the reference starts from exactly what the GPU holds.
inline std::vector<double> random_values(std::mt19937_64& rng, size_t n, ddp_dtype_t d) {
  std::uniform_real_distribution<double> u(-2.0, 2.0);
  std::vector<double> v(n);
  for (double& x : v) x = u(rng);
  return decode(encode(v, d), d);
}

inline void upload(void* dev, const std::vector<double>& v, ddp_dtype_t d, cudaStream_t s = nullptr) {
  std::vector<char> b = encode(v, d);
  CUDA_OK(cudaMemcpyAsync(dev, b.data(), b.size(), cudaMemcpyHostToDevice, s));
  CUDA_OK(cudaStreamSynchronize(s));
}

inline std::vector<double> download(const void* dev, size_t n, ddp_dtype_t d) {
  std::vector<char> b(n * dsize(d));
  CUDA_OK(cudaMemcpy(b.data(), dev, b.size(), cudaMemcpyDeviceToHost));
  return decode(b, d);
}

// Relative error allowed after a few roundings in dtype d (or f32 on the wire).
inline double tolerance(ddp_dtype_t d) {
  switch (d) {
    case DDP_F16: return 4.0 * 9.8e-4;
    case DDP_BF16: return 4.0 * 7.9e-3;
    case DDP_F32: return 4.0 * 1.2e-7;
    default: return 4.0 * 2.3e-16;
  }
}

// Number of elements of got that differ from want by more than the tolerance (first few printed).
inline size_t mismatches(const std::vector<double>& got, const std::vector<double>& want, ddp_dtype_t d,
                         const char* what) {
  size_t bad = 0;
  const double tol = tolerance(d);
  for (size_t i = 0; i < got.size(); ++i) {
    double err = std::fabs(got[i] - want[i]);
    if (!(err <= tol * std::fabs(want[i]) + tol * 1e-3)) {
      if (bad < 5) std::printf("  %s[%zu]: got %.9g want %.9g (%s)\n", what, i, got[i], want[i], dname(d));
      ++bad;
    }
  }
  return bad;
}

}  // namespace gt
