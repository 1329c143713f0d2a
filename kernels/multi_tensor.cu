// The CUDA kernels of the device backend. Element arithmetic comes from elementwise.h, the same code
// the host backend runs (and its unit tests cover).
#include "multi_tensor.h"

#include <cub/device/device_memcpy.cuh>

#include "elementwise.h"

namespace ddp {
namespace kern {

namespace {

// One block per kChunk elements of one segment; the block finds its segment by binary search over
// first_block (every segment has at least one block, so first_block is strictly increasing).
template <class S, class D>
__global__ void __launch_bounds__(kThreads)
    multi_tensor_kernel(const SegDesc* __restrict__ segs, int nseg, void* flat, int pack, double scale) {
  const uint64_t b = blockIdx.x;
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (segs[mid].first_block <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  const SegDesc sg = segs[lo];
  const uint64_t begin = (b - sg.first_block) * kChunk;
  const uint64_t end = begin + kChunk < sg.numel ? begin + kChunk : sg.numel;
  const bool unit = scale == 1.0;
  typedef typename S::storage SIn;
  typedef typename D::storage DOut;
  if (pack) {
    DOut* out = static_cast<DOut*>(flat) + sg.offset;
    if (sg.zero) {
      for (uint64_t i = begin + threadIdx.x; i < end; i += blockDim.x) out[i] = DOut();
      return;
    }
    const SIn* in = static_cast<const SIn*>(sg.ptr);
    for (uint64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
      out[i] = elem::scaled_cast<S, D>(in[i], scale, unit);
  } else {
    const SIn* in = static_cast<const SIn*>(flat) + sg.offset;
    DOut* out = static_cast<DOut*>(sg.ptr);
    for (uint64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
      out[i] = elem::scaled_cast<S, D>(in[i], scale, unit);
  }
}

template <class T>
__global__ void scale_kernel(typename T::storage* buf, size_t n, double scale) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    buf[i] = elem::scaled_cast<T, T>(buf[i], scale, false);
}

template <class T>
__global__ void nonfinite_kernel(const typename T::storage* buf, size_t n, unsigned* flag) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  bool bad = false;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    bad |= elem::is_nonfinite<T>(buf[i]);
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1u;
}

// Grid of a grid-stride kernel: enough blocks to fill any GPU, never more than the work.
unsigned grid_for(size_t n) {
  size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 4096 ? (blocks ? blocks : 1) : 4096);
}

template <class S, class D>
cudaError_t launch_typed(const SegDesc* segs, int nseg, uint64_t total_blocks, void* flat, int pack, double scale,
                         cudaStream_t stream) {
  multi_tensor_kernel<S, D>
      <<<static_cast<unsigned>(total_blocks), kThreads, 0, stream>>>(segs, nseg, flat, pack, scale);
  return cudaGetLastError();
}

template <class S>
cudaError_t launch_from(const SegDesc* segs, int nseg, uint64_t total_blocks, ddp_dtype_t dst, void* flat, int pack,
                        double scale, cudaStream_t stream) {
  switch (dst) {
    case DDP_F16: return launch_typed<S, elem::F16>(segs, nseg, total_blocks, flat, pack, scale, stream);
    case DDP_BF16: return launch_typed<S, elem::BF16>(segs, nseg, total_blocks, flat, pack, scale, stream);
    case DDP_F32: return launch_typed<S, elem::F32>(segs, nseg, total_blocks, flat, pack, scale, stream);
    case DDP_F64: return launch_typed<S, elem::F64>(segs, nseg, total_blocks, flat, pack, scale, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_multi_tensor(const SegDesc* segs, int nseg, uint64_t total_blocks, ddp_dtype_t src, ddp_dtype_t dst,
                                void* flat, int pack, double scale, cudaStream_t stream) {
  if (nseg <= 0 || total_blocks == 0) return cudaSuccess;
  if (total_blocks > 0x7fffffffull) return cudaErrorInvalidConfiguration;
  switch (src) {
    case DDP_F16: return launch_from<elem::F16>(segs, nseg, total_blocks, dst, flat, pack, scale, stream);
    case DDP_BF16: return launch_from<elem::BF16>(segs, nseg, total_blocks, dst, flat, pack, scale, stream);
    case DDP_F32: return launch_from<elem::F32>(segs, nseg, total_blocks, dst, flat, pack, scale, stream);
    case DDP_F64: return launch_from<elem::F64>(segs, nseg, total_blocks, dst, flat, pack, scale, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t batched_copy(void* temp, size_t* temp_bytes, void* const* in, void* const* out, const size_t* sizes, int n,
                         cudaStream_t stream) {
  return cub::DeviceMemcpy::Batched(temp, *temp_bytes, in, out, sizes, n, stream);
}

cudaError_t launch_scale(void* buf, size_t n, ddp_dtype_t dtype, double scale, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned grid = grid_for(n);
  switch (dtype) {
    case DDP_F16: scale_kernel<elem::F16><<<grid, kThreads, 0, stream>>>(static_cast<uint16_t*>(buf), n, scale); break;
    case DDP_BF16:
      scale_kernel<elem::BF16><<<grid, kThreads, 0, stream>>>(static_cast<uint16_t*>(buf), n, scale);
      break;
    case DDP_F32: scale_kernel<elem::F32><<<grid, kThreads, 0, stream>>>(static_cast<float*>(buf), n, scale); break;
    case DDP_F64: scale_kernel<elem::F64><<<grid, kThreads, 0, stream>>>(static_cast<double*>(buf), n, scale); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_nonfinite(const void* buf, size_t n, ddp_dtype_t dtype, unsigned* flag, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned grid = grid_for(n);
  switch (dtype) {
    case DDP_F16:
      nonfinite_kernel<elem::F16><<<grid, kThreads, 0, stream>>>(static_cast<const uint16_t*>(buf), n, flag);
      break;
    case DDP_BF16:
      nonfinite_kernel<elem::BF16><<<grid, kThreads, 0, stream>>>(static_cast<const uint16_t*>(buf), n, flag);
      break;
    case DDP_F32:
      nonfinite_kernel<elem::F32><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(buf), n, flag);
      break;
    case DDP_F64:
      nonfinite_kernel<elem::F64><<<grid, kThreads, 0, stream>>>(static_cast<const double*>(buf), n, flag);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kern
}  // namespace ddp
