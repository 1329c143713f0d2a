// The CUDA device on its own: pack/unpack of segment tables against the host backend (the same
// element code, so results must be bitwise equal), the CUB copy and multi-tensor kernel paths, zero
// segments, table re-uploads, scale, fill, the NaN/Inf scan, bad pointers, device restore.
#include <cuda_runtime_api.h>

#include <memory>

#include "core/backend.hpp"
#include "backends/cuda/cuda_device.hpp"
#include "gpu_test.hpp"
#include "host/host_device.hpp"

using namespace ddp;
using gt::dsize;

namespace {

struct Grads {
  std::vector<size_t> numel;
  std::vector<void*> dev;
  std::vector<std::vector<char>> host;
  size_t total = 0;
};

Grads make_grads(std::mt19937_64& rng, ddp_dtype_t d, int n) {
  Grads g;
  std::uniform_int_distribution<int> pick(0, 3);
  const size_t sizes[] = {1, 7, 8193, 70001};  // one element, odd, just over a block chunk, many chunks
  for (int i = 0; i < n; ++i) {
    size_t k = sizes[pick(rng)] + static_cast<size_t>(i);
    g.numel.push_back(k);
    g.host.push_back(gt::encode(gt::random_values(rng, k, d), d));
    void* p = nullptr;
    CUDA_OK(cudaMalloc(&p, k * dsize(d)));
    CUDA_OK(cudaMemcpy(p, g.host.back().data(), k * dsize(d), cudaMemcpyHostToDevice));
    g.dev.push_back(p);
    g.total += k;
  }
  return g;
}

void free_grads(Grads& g) {
  for (void* p : g.dev) cudaFree(p);
}

SegmentTable table_of(const std::vector<void*>& ptrs, const std::vector<size_t>& numel) {
  SegmentTable t;
  size_t off = 0;
  for (size_t i = 0; i < ptrs.size(); ++i) {
    t.segs.push_back(Segment{ptrs[i], off, numel[i], 0});
    off += numel[i];
  }
  return t;
}

}  // namespace

GPU_TEST_CASE("cuda device: pack and unpack match the host backend bitwise, every dtype pair") {
  std::mt19937_64 rng(gt::seed());
  CudaDevice dev(0);
  HostDevice host;
  std::unique_ptr<Stream> s = dev.make_stream(0);
  std::unique_ptr<Stream> hs = host.make_stream(0);
  const ddp_dtype_t types[] = {DDP_F16, DDP_BF16, DDP_F32, DDP_F64};
  const double scales[] = {1.0, 0.25, 1.0 / 3.0};
  for (ddp_dtype_t src : types) {
    for (ddp_dtype_t wire : types) {
      for (double scale : scales) {
        for (int zero_some = 0; zero_some < 2; ++zero_some) {
          CAPTURE(gt::dname(src));
          CAPTURE(gt::dname(wire));
          CAPTURE(scale);
          CAPTURE(zero_some);
          Grads g = make_grads(rng, src, 9);
          SegmentTable dt = table_of(g.dev, g.numel);
          std::vector<void*> hp;
          for (auto& h : g.host) hp.push_back(h.data());
          SegmentTable ht = table_of(hp, g.numel);
          if (zero_some) dt.segs[3].zero = ht.segs[3].zero = 1;
          // pack: GPU vs host
          void* flat = dev.alloc(g.total * dsize(wire));
          dev.pack(dt, static_cast<Dtype>(src), flat, static_cast<Dtype>(wire), scale, Span{0, SIZE_MAX}, *s);
          std::vector<char> want(g.total * dsize(wire));
          host.pack(ht, static_cast<Dtype>(src), want.data(), static_cast<Dtype>(wire), scale, Span{0, SIZE_MAX}, *hs);
          s->drain(Deadline::never());
          std::vector<char> got(want.size());
          CUDA_OK(cudaMemcpy(got.data(), flat, got.size(), cudaMemcpyDeviceToHost));
          CHECK(std::memcmp(got.data(), want.data(), got.size()) == 0);
          // unpack back into the grads: GPU vs host
          dev.unpack(flat, static_cast<Dtype>(wire), dt, static_cast<Dtype>(src), scale, Span{0, SIZE_MAX}, *s);
          host.unpack(want.data(), static_cast<Dtype>(wire), ht, static_cast<Dtype>(src), scale, Span{0, SIZE_MAX},
                      *hs);
          s->drain(Deadline::never());
          for (size_t i = 0; i < g.dev.size(); ++i) {
            std::vector<char> b(g.numel[i] * dsize(src));
            CUDA_OK(cudaMemcpy(b.data(), g.dev[i], b.size(), cudaMemcpyDeviceToHost));
            CHECK_MESSAGE(std::memcmp(b.data(), g.host[i].data(), b.size()) == 0, "segment ", i);
          }
          dev.free(flat);
          free_grads(g);
        }
      }
    }
  }
}

GPU_TEST_CASE("cuda device: plain copies against a float64 reference, and tables upload only on change") {
  std::mt19937_64 rng(gt::seed() + 1);
  CudaDevice dev(0);
  std::unique_ptr<Stream> s = dev.make_stream(0);
  Grads g = make_grads(rng, DDP_F32, 50);
  SegmentTable t = table_of(g.dev, g.numel);
  void* flat = dev.alloc(g.total * 4);
  const uint64_t u0 = dev.uploads();
  for (int it = 0; it < 3; ++it) dev.pack(t, Dtype::F32, flat, Dtype::F32, 1.0, Span{0, SIZE_MAX}, *s);
  CHECK(dev.uploads() == u0 + 1);  // same version, same buffer: uploaded once
  s->drain(Deadline::never());
  std::vector<double> got = gt::download(flat, g.total, DDP_F32);
  size_t off = 0;
  for (size_t i = 0; i < g.dev.size(); ++i) {
    std::vector<double> want = gt::decode(g.host[i], DDP_F32);
    std::vector<double> part(got.begin() + static_cast<long>(off), got.begin() + static_cast<long>(off + g.numel[i]));
    CHECK(gt::mismatches(part, want, DDP_F64, "packed") == 0);  // plain copies are exact
    off += g.numel[i];
  }
  // A grad moves: the reducer bumps the version, the device uploads again (once).
  void* moved = nullptr;
  CUDA_OK(cudaMalloc(&moved, g.numel[7] * 4));
  CUDA_OK(cudaMemset(moved, 0, g.numel[7] * 4));
  t.segs[7].ptr = moved;
  ++t.version;
  dev.unpack(flat, Dtype::F32, t, Dtype::F32, 1.0, Span{0, SIZE_MAX}, *s);
  dev.unpack(flat, Dtype::F32, t, Dtype::F32, 1.0, Span{0, SIZE_MAX}, *s);
  CHECK(dev.uploads() == u0 + 2);
  s->drain(Deadline::never());
  CHECK(gt::mismatches(gt::download(moved, g.numel[7], DDP_F32), gt::decode(g.host[7], DDP_F32), DDP_F64, "moved") ==
        0);
  cudaFree(moved);
  dev.free(flat);
  free_grads(g);
}

GPU_TEST_CASE("cuda device: scale, fill_zero and the finiteness flag on 1 and 4 streams") {
  std::mt19937_64 rng(gt::seed() + 2);
  CudaDevice dev(0);
  dev.reserve_flags(2);
  // One scan into slot 1, then the flag taken (and cleared) as Reducer::finish does.
  auto has_nonfinite = [&dev](const void* buf, size_t n, Dtype d, Stream& s) {
    dev.scan_nonfinite(buf, n, d, 1, s);
    return dev.take_nonfinite(1, s);
  };
  for (int ns : {1, 4}) {
    std::vector<std::unique_ptr<Stream>> streams;
    for (int i = 0; i < ns; ++i) streams.push_back(dev.make_stream(i));
    for (ddp_dtype_t d : {DDP_F16, DDP_BF16, DDP_F32, DDP_F64}) {
      CAPTURE(gt::dname(d));
      const size_t n = 100003;
      std::vector<double> v = gt::random_values(rng, n, d);
      void* buf = dev.alloc(n * dsize(d));
      gt::upload(buf, v, d);
      Stream& s = *streams[static_cast<size_t>(d) % static_cast<size_t>(ns)];
      CHECK_FALSE(has_nonfinite(buf, n, static_cast<Dtype>(d), s));
      dev.scale(buf, n, static_cast<Dtype>(d), 0.5, s);
      s.drain(Deadline::never());
      std::vector<double> want(v);
      for (double& x : want) x *= 0.5;
      CHECK(gt::mismatches(gt::download(buf, n, d), want, d, "scaled") == 0);
      // one NaN in the middle
      std::vector<double> one = {std::nan("")};
      gt::upload(static_cast<char*>(buf) + 5000 * dsize(d), one, d);
      CHECK(has_nonfinite(buf, n, static_cast<Dtype>(d), s));
      dev.fill_zero(buf, n, static_cast<Dtype>(d), s);
      s.drain(Deadline::never());
      std::vector<double> z = gt::download(buf, n, d);
      bool all_zero = true;
      for (double x : z) all_zero = all_zero && x == 0.0;
      CHECK(all_zero);
      CHECK_FALSE(has_nonfinite(buf, n, static_cast<Dtype>(d), s));
      dev.free(buf);
    }
  }
}

GPU_TEST_CASE("cuda device: the int8 wire's quantization and rank-order sum match the host backend bitwise") {
  std::mt19937_64 rng(gt::seed() + 5);
  CudaDevice dev(0);
  HostDevice host;
  std::unique_ptr<Stream> s = dev.make_stream(0), hs = host.make_stream(0);
  for (ddp_dtype_t d : {DDP_F32, DDP_F64}) {
    CAPTURE(gt::dname(d));
    const size_t n = 70001;  // 274 blocks, the last one short
    const int world = 3;
    const size_t cb = elem::int8_chunk_bytes(n);
    std::vector<char> host_chunks(cb * world);
    void* dev_chunks = dev.alloc(cb * world);
    std::vector<double> out_ref;
    for (int r = 0; r < world; ++r) {
      std::vector<double> v = gt::random_values(rng, n, d);
      v[100 + static_cast<size_t>(r)] = r == 1 ? std::nan("") : v[100];  // a NaN block on rank 1
      std::vector<float> res(n, 0.001f * static_cast<float>(r));
      const std::vector<char> bytes = gt::encode(v, d);
      host.int8_quantize(bytes.data(), static_cast<Dtype>(d), n, res.data(), host_chunks.data() + cb * r, *hs);
      void* x = dev.alloc(bytes.size());
      float* dres = static_cast<float*>(dev.alloc(n * sizeof(float)));
      CUDA_OK(cudaMemcpy(x, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
      std::vector<float> res0(n, 0.001f * static_cast<float>(r));
      CUDA_OK(cudaMemcpy(dres, res0.data(), n * sizeof(float), cudaMemcpyHostToDevice));
      dev.int8_quantize(x, static_cast<Dtype>(d), n, dres, static_cast<char*>(dev_chunks) + cb * r, *s);
      s->drain(Deadline::never());
      std::vector<float> got_res(n);
      CUDA_OK(cudaMemcpy(got_res.data(), dres, n * sizeof(float), cudaMemcpyDeviceToHost));
      CHECK(std::memcmp(got_res.data(), res.data(), n * sizeof(float)) == 0);
      dev.free(x);
      dev.free(dres);
    }
    std::vector<char> got_chunks(cb * world);
    CUDA_OK(cudaMemcpy(got_chunks.data(), dev_chunks, cb * world, cudaMemcpyDeviceToHost));
    for (int r = 0; r < world; ++r)  // the padding past each chunk's values is not written
      CHECK(std::memcmp(got_chunks.data() + cb * r, host_chunks.data() + cb * r, elem::int8_blocks(n) * 4 + n) == 0);
    std::vector<char> want(n * dsize(d)), got(n * dsize(d));
    host.int8_dequant_sum(host_chunks.data(), cb, world, n, static_cast<Dtype>(d), want.data(), *hs);
    void* out = dev.alloc(got.size());
    dev.int8_dequant_sum(dev_chunks, cb, world, n, static_cast<Dtype>(d), out, *s);
    s->drain(Deadline::never());
    CUDA_OK(cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost));
    CHECK(std::memcmp(got.data(), want.data(), got.size()) == 0);
    dev.free(out);
    dev.free(dev_chunks);
  }
}

GPU_TEST_CASE("cuda device: a host pointer in a table is refused before any kernel runs") {
  CudaDevice dev(0);
  std::unique_ptr<Stream> s = dev.make_stream(0);
  std::vector<float> host_grad(1000, 1.0f);
  void* flat = dev.alloc(1000 * 4);
  SegmentTable t = table_of({host_grad.data()}, {1000});
  bool threw = false;
  try {
    dev.pack(t, Dtype::F32, flat, Dtype::F32, 1.0, Span{0, SIZE_MAX}, *s);
  } catch (const Error& e) {
    threw = true;
    CHECK(e.status() == DDP_ERR_CUDA);
    CHECK(std::string(e.what()).find("not memory CUDA device") != std::string::npos);
  }
  CHECK(threw);
  s->drain(Deadline::never());  // the context is intact: no fault was raised on the device
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  dev.free(flat);
}

GPU_TEST_CASE("cuda device: the caller's current device is restored") {
  int n = 0;
  CUDA_OK(cudaGetDeviceCount(&n));
  const int other = n > 1 ? 1 : 0;
  CUDA_OK(cudaSetDevice(other));
  {
    CudaDevice dev(0);
    std::unique_ptr<Stream> s = dev.make_stream(0);
    void* p = dev.alloc(64);
    dev.fill_zero(p, 16, Dtype::F32, *s);
    s->drain(Deadline::never());
    dev.free(p);
  }
  int now = -1;
  CUDA_OK(cudaGetDevice(&now));
  CHECK(now == other);
  CUDA_OK(cudaSetDevice(0));
}
