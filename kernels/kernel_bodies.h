// The bodies of the CUDA kernels, as __host__ __device__ code: what one thread of one block does,
// with its indices passed in. The __global__ kernels of multi_tensor.cu call them with blockIdx,
// threadIdx, blockDim and gridDim; the simulated runtime of tests/gpusim calls them for every thread
// of the same grid, so the index arithmetic (chunks, the binary search over first_block,
// grid-stride loops) that a GPU runs is what the simulated suites test. Also the launch geometry and
// the dtype dispatch, shared the same way.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "ddp.h"
#include "elementwise.h"

namespace ddp {
namespace kern {

// Elements one block of the multi-tensor kernel handles: a segment of n elements takes
// ceil(n / kChunk) blocks.
constexpr uint64_t kChunk = 8192;
constexpr int kThreads = 256;

// One grad of a bucket as the multi-tensor kernel sees it. `first_block` is the sum of the block
// counts of the segments before it (blocks find their segment by binary search on it).
struct SegDesc {
  void* ptr;        // the grad's storage
  uint64_t offset;  // in elements of the flat buffer
  uint64_t numel;
  uint64_t first_block;
  uint32_t zero;  // pack writes zeros for this segment instead of reading ptr
  uint32_t pad;
};

inline uint64_t blocks_for(uint64_t numel) { return (numel + kChunk - 1) / kChunk; }

// Grid of a grid-stride kernel: enough blocks to fill any GPU, never more than the work.
inline unsigned grid_for(size_t n) {
  size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 4096 ? (blocks ? blocks : 1) : 4096);
}

// The thread bodies have internal linkage where the element functions do (elementwise.h).
#if defined(DDP_ELEM_CONTRACTS)
namespace {
#endif

// The segment block `b` works on: the last one whose first_block is <= b (every segment has at
// least one block, so first_block is strictly increasing).
DDP_HD int segment_of(const SegDesc* segs, int nseg, uint64_t b) {
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (segs[mid].first_block <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Multi-tensor scaled cast, thread `t` of block `b` (blocks of `bdim` threads): one kChunk of one
// segment per block, the block's threads striding over it. pack: flat[offset + i] = D(seg[i] * scale)
// (zeros for zero segments); unpack: seg[i] = D(flat[offset + i] * scale).
template <class S, class D>
DDP_HD void multi_tensor_thread(const SegDesc* segs, int nseg, void* flat, int pack, double scale, uint64_t b,
                                unsigned t, unsigned bdim) {
  const SegDesc sg = segs[segment_of(segs, nseg, b)];
  const uint64_t begin = (b - sg.first_block) * kChunk;
  const uint64_t end = begin + kChunk < sg.numel ? begin + kChunk : sg.numel;
  const bool unit = scale == 1.0;
  typedef typename S::storage SIn;
  typedef typename D::storage DOut;
  if (pack) {
    DOut* out = static_cast<DOut*>(flat) + sg.offset;
    if (sg.zero) {
      for (uint64_t i = begin + t; i < end; i += bdim) out[i] = DOut();
      return;
    }
    const SIn* in = static_cast<const SIn*>(sg.ptr);
    for (uint64_t i = begin + t; i < end; i += bdim) out[i] = elem::scaled_cast<S, D>(in[i], scale, unit);
  } else {
    const SIn* in = static_cast<const SIn*>(flat) + sg.offset;
    DOut* out = static_cast<DOut*>(sg.ptr);
    for (uint64_t i = begin + t; i < end; i += bdim) out[i] = elem::scaled_cast<S, D>(in[i], scale, unit);
  }
}

// In-place scaling, grid-stride: thread `t` of block `b`, `bdim` threads per block, `gdim` blocks.
template <class T>
DDP_HD void scale_thread(typename T::storage* buf, size_t n, double scale, size_t b, size_t t, size_t bdim,
                         size_t gdim) {
  const size_t stride = gdim * bdim;
  for (size_t i = b * bdim + t; i < n; i += stride) buf[i] = elem::scaled_cast<T, T>(buf[i], scale, false);
}

// The NaN/Inf scan, grid-stride: whether this thread saw one (the block ORs its threads' answers and
// thread 0 sets the flag).
template <class T>
DDP_HD bool nonfinite_thread(const typename T::storage* buf, size_t n, size_t b, size_t t, size_t bdim, size_t gdim) {
  const size_t stride = gdim * bdim;
  bool bad = false;
  for (size_t i = b * bdim + t; i < n; i += stride) bad |= elem::is_nonfinite<T>(buf[i]);
  return bad;
}

// The norm's terms, grid-stride: this thread's sum of the squares of its finite elements, in float64,
// and its count of NaN and Inf (left out of the sum).
template <class T>
DDP_HD void norm_thread(const typename T::storage* buf, size_t n, size_t b, size_t t, size_t bdim, size_t gdim,
                        double* sumsq, double* bad) {
  const size_t stride = gdim * bdim;
  double s = 0.0, k = 0.0;
  for (size_t i = b * bdim + t; i < n; i += stride) {
    if (elem::is_nonfinite<T>(buf[i])) {
      k += 1.0;
      continue;
    }
    const double v = static_cast<double>(T::load(buf[i]));
    s += v * v;
  }
  *sumsq = s;
  *bad = k;
}

// A block's sum of its threads' terms in a fixed tree (the order a GPU's shared-memory reduction
// adds them): for half = bdim / 2, bdim / 4, ..., 1, thread t < half adds slot t + half into slot t.
DDP_HD void tree_step(double* slots, size_t t, size_t half) {
  if (t < half) slots[t] += slots[t + half];
}

// The int8 wire (DDP_COMPRESS_INT8): thread t of the grid quantizes int8 blocks t, t + stride, ...
// of x (elem::int8_quantize_block: the same code on the host and the GPU) into `chunk`, its scales
// first, then its values.
template <class T>
DDP_HD void int8_quantize_thread(const typename T::storage* x, float* residual, size_t n, char* chunk, size_t b,
                                 size_t t, size_t bdim, size_t gdim) {
  const size_t nblocks = elem::int8_blocks(n);
  float* scales = reinterpret_cast<float*>(chunk);
  int8_t* q = reinterpret_cast<int8_t*>(chunk + nblocks * 4);
  for (size_t k = b * bdim + t; k < nblocks; k += gdim * bdim) {
    const size_t lo = k * elem::kInt8Block, m = n - lo < elem::kInt8Block ? n - lo : elem::kInt8Block;
    elem::int8_quantize_block<T>(x + lo, residual + lo, m, scales + k, q + lo);
  }
}

// out[i] = the sum over `world` chunks (chunk_bytes apart) of q * scale, rank after rank, in T's
// math: the order of additions of the host's loops, so both give the same bits.
template <class T>
DDP_HD void int8_dequant_thread(const char* chunks, size_t chunk_bytes, int world, size_t n, typename T::storage* out,
                                size_t b, size_t t, size_t bdim, size_t gdim) {
  const size_t q_at = elem::int8_blocks(n) * 4;
  for (size_t i = b * bdim + t; i < n; i += gdim * bdim) {
    typename T::math acc = 0;
    for (int r = 0; r < world; ++r) {
      const char* c = chunks + static_cast<size_t>(r) * chunk_bytes;
      float scale;
      memcpy(&scale, c + (i / elem::kInt8Block) * 4, 4);
      acc = elem::int8_term<T>(acc, reinterpret_cast<const int8_t*>(c + q_at)[i], scale);
    }
    out[i] = T::store(acc);
  }
}

#if defined(DDP_ELEM_CONTRACTS)
}  // namespace
#endif

// Calls f(elem::F16{}) ... f(elem::F64{}) for `d`; false for a value that is no dtype.
template <class F>
inline bool with_dtype(ddp_dtype_t d, F&& f) {
  switch (d) {
    case DDP_F16: f(elem::F16{}); return true;
    case DDP_BF16: f(elem::BF16{}); return true;
    case DDP_F32: f(elem::F32{}); return true;
    case DDP_F64: f(elem::F64{}); return true;
    default: return false;
  }
}

}  // namespace kern
}  // namespace ddp
