// make bench's section 9: the compressed wires' host loops, one pass at a time, against a plain
// memcpy of the same bytes (a pass that reads R bytes and writes W is set against a memcpy of
// (R + W) / 2 bytes, which reads and writes that much). Each pass on the portable path
// (DDP_HOST_SIMD=0) and on the one this CPU takes by default; the target is the latter within 1.3x
// of the memcpy. One process, no communicator: it calls the host loops themselves, so it links the
// static library (the functions are not exported by the shared one).
//
//   host_loops OUTDIR [ELEMENTS]     (ELEMENTS: per pass, default 16M: larger than the caches)
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "host/host_kernels.hpp"
#include "kernels/elementwise.h"

using namespace ddp;

namespace {

double now_ms() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) / 1e6;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The buffers of every pass, written once before timing so that no page fault is timed.
struct Buffers {
  size_t n;
  std::vector<float> f32, out32, residual;
  std::vector<uint16_t> h16a, h16b, h16out;
  std::vector<char> chunks, copy_from, copy_to;
  static constexpr int kWorld = 2;  // the dequantized sum's ranks
  explicit Buffers(size_t n_) : n(n_), f32(n_), out32(n_), residual(n_, 0.0f), h16a(n_), h16b(n_), h16out(n_) {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (size_t i = 0; i < n; ++i) f32[i] = u(rng) * std::ldexp(1.0f, int(rng() % 16) - 12);  // grad-like
    host::convert(f32.data(), Dtype::F32, h16a.data(), Dtype::F16, n, 1.0);
    host::convert(f32.data(), Dtype::F32, h16b.data(), Dtype::F16, n, 0.5);
    const size_t cb = elem::int8_chunk_bytes(n);
    chunks.assign(cb * kWorld, 0);
    for (int r = 0; r < kWorld; ++r) host::int8_quantize(f32.data(), Dtype::F32, n, residual.data(), &chunks[r * cb]);
    copy_from.assign(7 * n + 8, 1);  // the largest memcpy below: int8 quantize's 13 bytes, halved
    copy_to.assign(copy_from.size(), 0);
  }
};

struct Pass {
  const char* name;
  double bytes_per_element;  // read + written
  void (*run)(Buffers&);
};

const Pass kPasses[] = {
    {"f32 -> fp16", 4 + 2,
     [](Buffers& b) { host::convert(b.f32.data(), Dtype::F32, b.h16out.data(), Dtype::F16, b.n, 1.0); }},
    {"fp16 -> f32 (x 0.5)", 2 + 4,
     [](Buffers& b) { host::convert(b.h16a.data(), Dtype::F16, b.out32.data(), Dtype::F32, b.n, 0.5); }},
    {"fp16 + fp16 -> fp16", 2 + 2 + 2,
     [](Buffers& b) { host::sum_scaled(b.h16a.data(), b.h16b.data(), b.h16out.data(), b.n, Dtype::F16, 1.0); }},
    {"f32 -> bf16", 4 + 2,
     [](Buffers& b) { host::convert(b.f32.data(), Dtype::F32, b.h16out.data(), Dtype::BF16, b.n, 1.0); }},
    {"bf16 -> f32 (x 0.5)", 2 + 4,
     [](Buffers& b) { host::convert(b.h16a.data(), Dtype::BF16, b.out32.data(), Dtype::F32, b.n, 0.5); }},
    {"bf16 + bf16 -> bf16", 2 + 2 + 2,
     [](Buffers& b) { host::sum_scaled(b.h16a.data(), b.h16b.data(), b.h16out.data(), b.n, Dtype::BF16, 1.0); }},
    {"int8 quantize", 4 + 4 + 4 + 1,  // x and residual in; residual and the values out
     [](Buffers& b) { host::int8_quantize(b.f32.data(), Dtype::F32, b.n, b.residual.data(), b.chunks.data()); }},
    {"int8 dequant-sum (2 ranks)", Buffers::kWorld * 1 + 4,
     [](Buffers& b) {
       host::int8_dequant_sum(b.chunks.data(), elem::int8_chunk_bytes(b.n), Buffers::kWorld, b.n, Dtype::F32,
                              b.out32.data());
     }},
};

// One timing of a pass on a path (DDP_HOST_SIMD as given, the choice made again).
double time_pass(const Pass& p, Buffers& b, bool portable) {
  setenv("DDP_HOST_SIMD", portable ? "0" : "1", 1);
  host::choose_simd_path_again();
  const double t0 = now_ms();
  p.run(b);
  return now_ms() - t0;
}

double time_copy(Buffers& b, size_t bytes) {
  const double t0 = now_ms();
  std::memcpy(b.copy_to.data(), b.copy_from.data(), bytes);
  const double t = now_ms() - t0;
  if (b.copy_to[bytes / 2] != 1) std::abort();  // keeps the copy
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: host_loops OUTDIR [ELEMENTS]\n");
    return 2;
  }
  const size_t n = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : size_t(16) << 20;
  const int reps = 9;
  const double target = 1.3;
  Buffers b(n);
  setenv("DDP_HOST_SIMD", "1", 1);
  host::choose_simd_path_again();
  const bool simd = host::simd_path();
  std::printf(
      "\n## 9. host conversions: %zu elements a pass, one thread; default path here: %s\n\nmedian of %d "
      "interleaved rounds; each pass against a memcpy of its bytes read + written, halved\n\n| pass | memcpy ms | "
      "portable ms | x memcpy | default ms | x memcpy | target |\n|---|---:|---:|---:|---:|---:|---|\n",
      n, simd ? "AVX2 / F16C" : "portable (no AVX2 / F16C, or DDP_HOST_SIMD=0)", reps);
  std::string json;
  bool met = true;
  for (const Pass& p : kPasses) {
    const size_t bytes = size_t(p.bytes_per_element * double(n) / 2);
    std::vector<double> copy, portable, fast;
    time_pass(p, b, true), time_pass(p, b, false), time_copy(b, bytes);  // warm-up
    for (int r = 0; r < reps; ++r) {  // interleaved, so that a change of load hits every column alike
      copy.push_back(time_copy(b, bytes));
      portable.push_back(time_pass(p, b, true));
      fast.push_back(time_pass(p, b, false));
    }
    const double c = median(copy), po = median(portable), f = median(fast);
    const bool ok = f <= target * c;
    met = met && ok;
    std::printf("| %s | %.3f | %.3f | %.2f | %.3f | %.2f | %s (<= %.1f) |\n", p.name, c, po, po / c, f, f / c,
                ok ? "met" : "MISSED", target);
    char row[256];
    std::snprintf(row, sizeof row, "%s{\"pass\":\"%s\",\"memcpy_ms\":%.4f,\"portable_ms\":%.4f,\"default_ms\":%.4f}",
                  json.empty() ? "" : ",", p.name, c, po, f);
    json += row;
  }
  unsetenv("DDP_HOST_SIMD");
  std::printf("\ntarget (each pass on the default path within %.1fx a memcpy of its bytes): %s\n", target,
              met ? "met" : "MISSED");
  const std::string path = std::string(argv[1]) + "/host_loops.json";
  if (FILE* f = std::fopen(path.c_str(), "w")) {
    std::fprintf(f, "{\"bench\":\"host_loops\",\"elements\":%zu,\"simd\":%s,\"runs\":[%s]}\n", n,
                 simd ? "true" : "false", json.c_str());
    std::fclose(f);
  }
  return 0;
}
