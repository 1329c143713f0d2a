// The host loops' two paths, the portable element code and the AVX2 / F16C versions
// (lib/host/host_simd.cpp), against each other bit for bit through host::convert, host::sum_scaled
// and the int8 wire, both chosen in this process through DDP_HOST_SIMD. Every rank, and the GPU
// kernels, must put the same bits on the wire whichever path a rank's CPU takes, so no tolerance:
// random bit patterns, and the edge values of each conversion (NaN payloads, Infs, denormals, ties,
// fp16 overflow, bf16 carries; int8 blocks of NaN, Inf, zeros and maxima below 1 / FLT_MAX).
#include <doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "host/host_device.hpp"
#include "host/host_kernels.hpp"
#include "host/host_simd.hpp"
#include "kernels/elementwise.h"

using namespace ddp;

namespace {

// The host loops on one path for a scope: DDP_HOST_SIMD set and the choice made again.
struct OnPath {
  explicit OnPath(bool simd) {
    setenv("DDP_HOST_SIMD", simd ? "1" : "0", 1);
    host::choose_simd_path_again();
  }
  ~OnPath() {
    unsetenv("DDP_HOST_SIMD");
    host::choose_simd_path_again();
  }
};

bool have_simd() {
  if (host::simd::supported()) return true;
  MESSAGE("this CPU has no AVX2 / F16C: only the portable path runs here");
  return false;
}

float f32(uint32_t u) { return elem::bits_f32(u); }

// f32 values at every edge the 16-bit conversions have, both signs, among random bit patterns.
std::vector<float> edge_floats(size_t n, uint32_t seed) {
  const uint32_t edges[] = {
      0x7f800000, 0x7f800001, 0x7fc00000, 0x7fa12345, 0x7fffffff, 0xffc00001,  // Inf, NaNs (quiet, signaling)
      0x00000000, 0x00000001, 0x007fffff, 0x00800000,                          // zero, f32 denormals
      0x477fe000, 0x477fefff, 0x477ff000, 0x477fffff, 0x47800000, 0x7f7fffff,  // fp16's top: 65504 .. Inf
      0x33000000, 0x33000001, 0x33800000, 0x33c00000, 0x38800000, 0x387fffff,  // fp16 subnormals, ties
      0x38801000, 0x38803000, 0x3f801000, 0x3f803000, 0x3f800fff,              // fp16 ties to even
      0x3f808000, 0x3f818000, 0x3f80ffff, 0x7f7f8000, 0x7f7fffff, 0x3fffffff,  // bf16 ties and carries
      0x3f7fffff, 0x00008000, 0x00018000, 0x0000ffff};
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  const size_t ne = sizeof edges / sizeof edges[0];
  for (size_t i = 0; i < n; ++i) {
    uint32_t u = rng();
    if (i % 3 == 0) u = (u & 0x807fffffu) | ((100u + rng() % 45u) << 23);  // near fp16's range
    if (i % 5 == 0) u = edges[rng() % ne] | (rng() & 0x80000000u);
    if (i % 7 == 0) u &= 0xffffe000u | 0x1000u;        // fp16 ties
    if (i % 11 == 0) u = (u & 0xffff0000u) | 0x8000u;  // bf16 ties
    v[i] = f32(u);
  }
  return v;
}

std::vector<uint16_t> random_halves(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint16_t>(rng());
  return v;
}

std::vector<char> bytes_of(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  return std::vector<char>(c, c + n);
}

// host::convert of src (n elements of s) to d on the given path, as bytes.
std::vector<char> convert_on(bool simd, const void* src, Dtype s, Dtype d, size_t n, double scale) {
  OnPath path(simd);
  REQUIRE(host::simd_path() == simd);
  std::vector<char> out(n * dtype_size(d) + 1, 0x5a);
  host::convert(src, s, out.data(), d, n, scale);
  return out;
}

const double kScales[] = {1.0, 0.5, 1.0 / 3.0, 3.0e-5, 65536.0, 1e-40};
const size_t kSizes[] = {1, 7, 8, 9, 17, 255, 1000, 4099};

}  // namespace

TEST_CASE("host SIMD path: DDP_HOST_SIMD=0 keeps the portable loops; otherwise the CPU decides, once") {
  {
    OnPath path(false);
    CHECK_FALSE(host::simd_path());
  }
  {
    OnPath path(true);
    CHECK(host::simd_path() == host::simd::supported());
    setenv("DDP_HOST_SIMD", "0", 1);  // read once: a later change waits for the next choice
    CHECK(host::simd_path() == host::simd::supported());
  }
  CHECK(host::simd_path() == host::simd::supported());  // unset: the default is the CPU's answer
}

TEST_CASE("host SIMD path: f32 -> fp16 / bf16 with a scale, bit for bit the portable casts") {
  if (!have_simd()) return;
  for (size_t n : kSizes)
    for (double scale : kScales)
      for (Dtype d : {Dtype::F16, Dtype::BF16}) {
        const std::vector<float> x = edge_floats(n, static_cast<uint32_t>(n * 31 + (d == Dtype::F16)));
        INFO("n ", n, " scale ", scale, " to ", dtype_name(d));
        REQUIRE(convert_on(true, x.data(), Dtype::F32, d, n, scale) ==
                convert_on(false, x.data(), Dtype::F32, d, n, scale));
      }
}

TEST_CASE("host SIMD path: fp16 / bf16 -> f32, every bit pattern and with scales, bit for bit") {
  if (!have_simd()) return;
  std::vector<uint16_t> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) all[b] = static_cast<uint16_t>(b);
  for (Dtype s : {Dtype::F16, Dtype::BF16}) {
    INFO("from ", dtype_name(s));
    for (double scale : kScales)
      REQUIRE(convert_on(true, all.data(), s, Dtype::F32, all.size(), scale) ==
              convert_on(false, all.data(), s, Dtype::F32, all.size(), scale));
    for (size_t n : kSizes) {
      const std::vector<uint16_t> h = random_halves(n, static_cast<uint32_t>(n));
      REQUIRE(convert_on(true, h.data(), s, Dtype::F32, n, 0.25) ==
              convert_on(false, h.data(), s, Dtype::F32, n, 0.25));
    }
  }
}

TEST_CASE("host SIMD path: the 16-bit sums of the host reductions, in place or not, bit for bit") {
  if (!have_simd()) return;
  for (size_t n : kSizes)
    for (double scale : {1.0, 0.5, 1.0 / 3.0})
      for (Dtype d : {Dtype::F16, Dtype::BF16})
        for (bool in_place : {false, true}) {
          INFO("n ", n, " scale ", scale, " ", dtype_name(d), in_place ? " in place" : "");
          const std::vector<uint16_t> a = random_halves(n, static_cast<uint32_t>(n)), b = random_halves(n, 99);
          std::vector<char> got[2];
          for (bool simd : {false, true}) {
            OnPath path(simd);
            std::vector<uint16_t> x = a, out(n, 0x5a5a);
            host::sum_scaled(x.data(), b.data(), in_place ? x.data() : out.data(), n, d, scale);
            got[simd] = bytes_of(in_place ? x.data() : out.data(), n * 2);
          }
          REQUIRE(got[0] == got[1]);
        }
}

namespace {

// An int8 wire input of n elements: random magnitudes over many binades, with one of the edge cases
// spread over it (kind 0: none).
std::vector<float> int8_input(size_t n, int kind, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 17) - 8);
  const float tiny[] = {3.0e-37f, 1.0e-38f, 1.0e-40f, 1.0e-44f};
  for (size_t i = 0; i < n; ++i) switch (kind) {
      case 1: x[i] = i % 3 == 0 ? 0.0f : x[i] * tiny[(i / 256) % 4] / 256.0f; break;  // max < 3.7e-37
      case 2: x[i] = i % 97 == 5 ? std::nanf("") : x[i]; break;                       // NaN blocks
      case 3: x[i] = i == n / 2 ? -INFINITY : x[i]; break;                            // an Inf block
      case 4: x[i] = i % 256 < 200 ? 0.0f : x[i]; break;                              // zero blocks
      case 5: x[i] = std::round(x[i] * 4.0f) / 4.0f; break;  // halves of steps: ties of the rounding
      case 6: x[i] = edge_floats(1, seed + static_cast<uint32_t>(i))[0]; break;
      default: break;
    }
  return x;
}

}  // namespace

TEST_CASE("host SIMD path: int8 quantize (3 error-feedback rounds) and dequantized sum, bit for bit") {
  if (!have_simd()) return;
  const int world = 3;
  for (size_t n : {size_t(1), size_t(7), size_t(9), size_t(255), size_t(256), size_t(257), size_t(700)})
    for (int kind = 0; kind <= 6; ++kind) {
      INFO("n ", n, " kind ", kind);
      const size_t cb = elem::int8_chunk_bytes(n);
      std::vector<char> chunks[2];
      std::vector<float> residual[2][world], out[2];
      for (bool simd : {false, true}) {
        OnPath path(simd);
        chunks[simd].assign(cb * world, 0x5a);
        for (int r = 0; r < world; ++r) {
          const std::vector<float> x = int8_input(n, kind, static_cast<uint32_t>(n * 7 + r));
          residual[simd][r].assign(n, 0.0f);
          for (int round = 0; round < 3; ++round)  // the last round's chunk is summed
            host::int8_quantize(x.data(), Dtype::F32, n, residual[simd][r].data(), chunks[simd].data() + r * cb);
        }
        out[simd].assign(n, -1.0f);
        host::int8_dequant_sum(chunks[simd].data(), cb, world, n, Dtype::F32, out[simd].data());
      }
      REQUIRE(chunks[0] == chunks[1]);
      for (int r = 0; r < world; ++r)
        REQUIRE(bytes_of(residual[0][r].data(), n * 4) == bytes_of(residual[1][r].data(), n * 4));
      REQUIRE(bytes_of(out[0].data(), n * 4) == bytes_of(out[1].data(), n * 4));
    }
}

TEST_CASE("int8 spans (the copy layout's tiles): quantizing and summing a chunk span by span gives its bits") {
  std::mt19937 rng(77);
  for (bool simd : {false, true}) {
    if (simd && !host::simd::supported()) continue;
    OnPath path(simd);
    for (int t = 0; t < 40; ++t) {
      const size_t n = 1 + rng() % 5000, cb = elem::int8_chunk_bytes(n);
      const bool f64 = rng() % 4 == 0;
      const Dtype d = f64 ? Dtype::F64 : Dtype::F32;
      const size_t es = f64 ? 8 : 4;
      INFO("simd ", simd, " n ", n, " f64 ", f64);
      std::vector<char> x(n * es);
      const std::vector<float> v = int8_input(n, static_cast<int>(rng() % 7), rng());
      for (size_t i = 0; i < n; ++i) {
        if (f64) {
          const double w = v[i];
          std::memcpy(x.data() + i * 8, &w, 8);
        } else {
          std::memcpy(x.data() + i * 4, &v[i], 4);
        }
      }
      const int world = 1 + static_cast<int>(rng() % 3);
      std::vector<char> whole(cb * world, 0x5a), parts(cb * world, 0x5a);
      std::vector<float> res_whole(n, 0.25f), res_parts(n, 0.25f);
      for (int r = 0; r < world; ++r) {
        host::int8_quantize(x.data(), d, n, res_whole.data(), whole.data() + r * cb);
        // Spans of whole blocks in random lengths, the last one ending the chunk.
        for (size_t lo = 0; lo < n;) {
          const size_t len = std::min(n - lo, (1 + rng() % 5) * size_t(elem::kInt8Block));
          host::int8_quantize_span(x.data() + lo * es, d, n, lo, len, res_parts.data() + lo, parts.data() + r * cb);
          lo += len;
        }
      }
      REQUIRE(whole == parts);
      REQUIRE(bytes_of(res_whole.data(), n * 4) == bytes_of(res_parts.data(), n * 4));
      std::vector<char> sum_whole(n * es, 1), sum_parts(n * es, 2);
      host::int8_dequant_sum(whole.data(), cb, world, n, d, sum_whole.data());
      for (size_t lo = 0; lo < n;) {
        const size_t len = std::min(n - lo, (1 + rng() % 5) * size_t(elem::kInt8Block));
        host::int8_dequant_sum_span(whole.data(), cb, world, n, lo, len, d, sum_parts.data() + lo * es);
        lo += len;
      }
      REQUIRE(sum_whole == sum_parts);
    }
  }
}

TEST_CASE("int8 spans: a span that does not start a block, or runs past the chunk, is refused") {
  std::vector<float> x(600, 1.0f), res(600, 0.0f);
  std::vector<char> chunk(elem::int8_chunk_bytes(600));
  CHECK_THROWS(host::int8_quantize_span(x.data(), Dtype::F32, 600, 100, 256, res.data(), chunk.data()));
  CHECK_THROWS(host::int8_quantize_span(x.data(), Dtype::F32, 600, 256, 100, res.data(), chunk.data()));
  CHECK_THROWS(host::int8_quantize_span(x.data(), Dtype::F32, 600, 512, 256, res.data(), chunk.data()));
  CHECK_THROWS(host::int8_dequant_sum_span(chunk.data(), chunk.size(), 1, 600, 10, 5, Dtype::F32, x.data()));
  CHECK_NOTHROW(host::int8_quantize_span(x.data(), Dtype::F32, 600, 512, 88, res.data(), chunk.data()));
}

TEST_CASE("int8 rounds from the grads (copy layout): the bits of pack + quantize and of dequantize + unpack") {
  HostDevice dev;
  std::unique_ptr<Stream> s = dev.make_stream(0);
  std::mt19937 rng(99);
  for (int t = 0; t < 30; ++t) {
    const bool f64 = t % 3 == 2;
    const Dtype d = f64 ? Dtype::F64 : Dtype::F32;
    const size_t es = f64 ? 8 : 4;
    // Grads of random sizes (some below a tile, some spanning several), some unused (zero).
    SegmentTable table;
    std::vector<std::vector<char>> grads;
    size_t n = 0;
    for (int g = 0, ng = 1 + static_cast<int>(rng() % 6); g < ng; ++g) {
      const size_t k = 1 + rng() % (rng() % 2 ? 300 : 20000);
      const std::vector<float> v = int8_input(k, static_cast<int>(rng() % 7), rng());
      grads.emplace_back(k * es);
      for (size_t i = 0; i < k; ++i) {
        const double w = v[i];
        if (f64)
          std::memcpy(grads.back().data() + i * 8, &w, 8);
        else
          std::memcpy(grads.back().data() + i * 4, &v[i], 4);
      }
      table.segs.push_back(Segment{grads.back().data(), n, k, rng() % 5 == 0 ? 1u : 0u});
      n += k;
    }
    const double pre = t % 2 ? 1.0 : 1.0 / 3.0, post = t % 4 < 2 ? 1.0 : 0.5;
    // A round: whole blocks from a random block, to a random end.
    const size_t lo = (rng() % elem::int8_blocks(n)) * elem::kInt8Block, hi = lo + 1 + rng() % (n - lo);
    const size_t len = hi - lo, cb = elem::int8_chunk_bytes(len);
    INFO("try ", t, " n ", n, " round [", lo, ", ", hi, ") pre ", pre, " post ", post);
    std::vector<char> staged(n * es), chunk_ref(cb, 0x33), chunk(cb, 0x33);
    std::vector<float> res_ref(len, 0.125f), res(len, 0.125f);
    dev.pack(table, d, staged.data(), d, pre, Span{lo, hi}, *s);
    host::int8_quantize(staged.data() + lo * es, d, len, res_ref.data(), chunk_ref.data());
    dev.int8_quantize_grads(table, d, pre, Span{lo, hi}, res.data(), chunk.data(), *s);
    REQUIRE(chunk_ref == chunk);
    REQUIRE(bytes_of(res_ref.data(), len * 4) == bytes_of(res.data(), len * 4));
    // Back: two ranks' chunks summed into the grads.
    std::vector<char> two(2 * cb);
    std::memcpy(two.data(), chunk.data(), cb);
    std::memcpy(two.data() + cb, chunk_ref.data(), cb);
    std::vector<std::vector<char>> before = grads;
    host::int8_dequant_sum(two.data(), cb, 2, len, d, staged.data() + lo * es);
    dev.unpack(staged.data(), d, table, d, post, Span{lo, hi}, *s);
    const std::vector<std::vector<char>> want = grads;
    grads = before;  // the table points into grads' buffers, which assignment keeps
    dev.int8_dequant_grads(two.data(), cb, 2, Span{lo, hi}, table, d, post, *s);
    REQUIRE(grads == want);
  }
}

TEST_CASE("16-bit sums: a NaN sum is the default quiet NaN on both paths, whichever NaN came first") {
  // fp16 and bf16 NaNs of both signs and several payloads, quiet and signalling, against each other,
  // numbers and infinities (Inf - Inf); every lane position of a vector and its tail.
  const uint16_t f16[] = {0x7e00, 0xfe00, 0x7c01, 0xfd55, 0x7fff, 0x3c00, 0xfc00, 0x7c00};
  const uint16_t bf16[] = {0x7fc0, 0xffc0, 0x7f81, 0xffaa, 0x7fff, 0x3f80, 0xff80, 0x7f80};
  for (Dtype d : {Dtype::F16, Dtype::BF16}) {
    const uint16_t* v = d == Dtype::F16 ? f16 : bf16;
    const uint16_t want = d == Dtype::F16 ? 0x7e00 : 0x7fc0;
    std::vector<uint16_t> a, b;
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 8; ++j) {
        a.push_back(v[i]);
        b.push_back(v[j]);
      }
    a.resize(a.size() + 5, v[0]);  // a tail of 5 lanes
    b.resize(b.size() + 5, v[1]);
    for (bool simd : {false, true}) {
      if (simd && !host::simd::supported()) continue;
      OnPath path(simd);
      for (double scale : {1.0, 0.25}) {
        std::vector<uint16_t> out(a.size(), 1);
        host::sum_scaled(a.data(), b.data(), out.data(), a.size(), d, scale);
        for (size_t k = 0; k < a.size(); ++k) {
          const bool nan_in = (a[k] & 0x7fff) > (d == Dtype::F16 ? 0x7c00 : 0x7f80) ||
                              (b[k] & 0x7fff) > (d == Dtype::F16 ? 0x7c00 : 0x7f80) ||
                              ((a[k] & 0x7fff) == (d == Dtype::F16 ? 0x7c00 : 0x7f80) && (b[k] ^ a[k]) == 0x8000);
          if (!nan_in) continue;
          INFO("dtype ", dtype_name(d), " simd ", simd, " scale ", scale, " a ", a[k], " b ", b[k]);
          CHECK(out[k] == want);
        }
      }
    }
  }
}
