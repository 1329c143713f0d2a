// Bandwidth of flatten (pack) and unflatten (unpack) of one bucket of 1,000 f32 grads of mixed sizes,
// 1 GiB in all, against one plain device-to-device copy of the same bytes. Prints a table; with no
// CUDA device it prints one skip line and exits 0.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "core/backend.hpp"
#include "backends/cuda/cuda_device.hpp"

using namespace ddp;

#define BENCH_CUDA(call)                                                       \
  do {                                                                         \
    cudaError_t rc_ = (call);                                                  \
    if (rc_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(rc_)); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

namespace {

// 10 grads of 16 Mi elements, 90 of 1 Mi, 900 small ones of random size: 2^28 elements (1 GiB of f32).
std::vector<size_t> mixed_sizes(std::mt19937_64& rng) {
  const size_t total = size_t(1) << 28;
  std::vector<size_t> s(10, size_t(16) << 20);
  s.insert(s.end(), 90, size_t(1) << 20);
  size_t used = 10 * (size_t(16) << 20) + 90 * (size_t(1) << 20);
  const size_t rest = total - used;  // shared by 900 small grads
  std::vector<double> w(900);
  std::uniform_real_distribution<double> u(0.05, 1.95);
  double sum = 0;
  for (double& x : w) sum += (x = u(rng));
  size_t given = 0;
  for (size_t i = 0; i < 900; ++i) {
    size_t k = i + 1 == 900 ? rest - given : std::max<size_t>(1, static_cast<size_t>(w[i] / sum * rest));
    s.push_back(k);
    given += k;
  }
  std::shuffle(s.begin(), s.end(), rng);
  return s;
}

template <class F>
double time_ms(cudaStream_t s, int reps, F&& op) {
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) op();  // warm up (first call uploads the table, sizes CUB's storage)
  BENCH_CUDA(cudaEventRecord(a, s));
  for (int i = 0; i < reps; ++i) op();
  BENCH_CUDA(cudaEventRecord(b, s));
  BENCH_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / reps;
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("bench_flatten: skipped: no CUDA device is visible\n");
    return 0;
  }
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::mt19937_64 rng(42);
  std::vector<size_t> sizes = mixed_sizes(rng);
  size_t total = 0;
  for (size_t k : sizes) total += k;
  const size_t bytes = total * 4;

  try {
    CudaDevice dev(0);
    std::unique_ptr<Stream> st = dev.make_stream(0);
    cudaStream_t s = static_cast<cudaStream_t>(st->native());
    SegmentTable t;
    size_t off = 0;
    for (size_t k : sizes) {
      void* p = dev.alloc(k * 4);
      t.segs.push_back(Segment{p, off, k, 0});
      off += k;
    }
    void* flat = dev.alloc(bytes);
    void* copy = dev.alloc(bytes);
    const int reps = 10;
    struct Row {
      const char* what;
      double ms;
    };
    std::vector<Row> rows;
    rows.push_back({"d2d cudaMemcpyAsync, same bytes", time_ms(s, reps, [&] {
                      BENCH_CUDA(cudaMemcpyAsync(copy, flat, bytes, cudaMemcpyDeviceToDevice, s));
                    })});
    rows.push_back({"flatten, plain (CUB batched)", time_ms(s, reps, [&] {
                      dev.pack(t, Dtype::F32, flat, Dtype::F32, 1.0, Span{0, SIZE_MAX}, *st);
                    })});
    rows.push_back({"unflatten, plain (CUB batched)", time_ms(s, reps, [&] {
                      dev.unpack(flat, Dtype::F32, t, Dtype::F32, 1.0, Span{0, SIZE_MAX}, *st);
                    })});
    rows.push_back({"flatten, x0.5 (multi-tensor)", time_ms(s, reps, [&] {
                      dev.pack(t, Dtype::F32, flat, Dtype::F32, 0.5, Span{0, SIZE_MAX}, *st);
                    })});
    rows.push_back({"unflatten, x2 (multi-tensor)", time_ms(s, reps, [&] {
                      dev.unpack(flat, Dtype::F32, t, Dtype::F32, 2.0, Span{0, SIZE_MAX}, *st);
                    })});
    st->drain(Deadline::never());
    std::printf("\nflatten/unflatten bandwidth: %zu f32 grads, %.3f GiB, %s (%d reps each)\n", sizes.size(),
                bytes / 1073741824.0, prop.name, reps);
    std::printf("%-34s %10s %14s %10s\n", "operation", "ms", "GB/s (r+w)", "vs memcpy");
    for (const Row& r : rows)
      std::printf("%-34s %10.3f %14.1f %9.2fx\n", r.what, r.ms, 2.0 * bytes / (r.ms * 1e6), rows[0].ms / r.ms);
    for (const Segment& seg : t.segs) dev.free(seg.ptr);
    dev.free(flat);
    dev.free(copy);
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_flatten: %s\n", e.what());
    return 1;
  }
  return 0;
}
