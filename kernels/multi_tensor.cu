// The CUDA kernels of the device backend: thin __global__ shells over the thread bodies of
// kernel_bodies.h (the code the simulated suites run), and their launches.
#include "multi_tensor.h"

#include <cub/device/device_memcpy.cuh>
#include <utility>

namespace ddp {
namespace kern {

namespace {

template <class S, class D>
__global__ void __launch_bounds__(kThreads)
    multi_tensor_kernel(const SegDesc* __restrict__ segs, int nseg, void* flat, int pack, double scale) {
  multi_tensor_thread<S, D>(segs, nseg, flat, pack, scale, blockIdx.x, threadIdx.x, blockDim.x);
}

template <class T>
__global__ void scale_kernel(typename T::storage* buf, size_t n, double scale) {
  scale_thread<T>(buf, n, scale, blockIdx.x, threadIdx.x, blockDim.x, gridDim.x);
}

template <class T>
__global__ void nonfinite_kernel(const typename T::storage* buf, size_t n, unsigned* flag) {
  const bool bad = nonfinite_thread<T>(buf, n, blockIdx.x, threadIdx.x, blockDim.x, gridDim.x);
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1u;
}

template <class T>
__global__ void __launch_bounds__(kThreads) norm_kernel(const typename T::storage* buf, size_t n, double* partials) {
  __shared__ double sq[kThreads], bad[kThreads];
  norm_thread<T>(buf, n, blockIdx.x, threadIdx.x, blockDim.x, gridDim.x, &sq[threadIdx.x], &bad[threadIdx.x]);
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    __syncthreads();
    tree_step(sq, threadIdx.x, half);
    tree_step(bad, threadIdx.x, half);
  }
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = sq[0];
    partials[2 * blockIdx.x + 1] = bad[0];
  }
}

template <class T>
__global__ void int8_quantize_kernel(const typename T::storage* x, float* residual, size_t n, char* chunk) {
  int8_quantize_thread<T>(x, residual, n, chunk, blockIdx.x, threadIdx.x, blockDim.x, gridDim.x);
}

template <class T>
__global__ void int8_dequant_kernel(const char* chunks, size_t chunk_bytes, int world, size_t n,
                                    typename T::storage* out) {
  int8_dequant_thread<T>(chunks, chunk_bytes, world, n, out, blockIdx.x, threadIdx.x, blockDim.x, gridDim.x);
}

// A launch that reports its own result: cudaLaunchKernelEx returns it, where a <<<>>> launch is only
// checked through the thread's last error, which would consume (or mistake for ours) an error the
// caller has not read yet.
template <class... Params, class... Args>
cudaError_t launch(void (*kernel)(Params...), unsigned grid, unsigned block, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = nullptr;
  config.numAttrs = 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace

cudaError_t launch_int8_quantize(const void* x, ddp_dtype_t dtype, size_t n, float* residual, void* chunk,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  cudaError_t rc = cudaErrorInvalidValue;
  with_dtype(dtype, [&](auto t) {
    typedef decltype(t) T;
    rc = launch(int8_quantize_kernel<T>, grid_for(elem::int8_blocks(n)), kThreads, stream,
                static_cast<const typename T::storage*>(x), residual, n, static_cast<char*>(chunk));
  });
  return rc;
}

cudaError_t launch_int8_dequant(const void* chunks, size_t chunk_bytes, int world, size_t n, ddp_dtype_t dtype,
                                void* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  cudaError_t rc = cudaErrorInvalidValue;
  with_dtype(dtype, [&](auto t) {
    typedef decltype(t) T;
    rc = launch(int8_dequant_kernel<T>, grid_for(n), kThreads, stream, static_cast<const char*>(chunks), chunk_bytes,
                world, n, static_cast<typename T::storage*>(out));
  });
  return rc;
}

cudaError_t launch_multi_tensor(const SegDesc* segs, int nseg, uint64_t total_blocks, ddp_dtype_t src, ddp_dtype_t dst,
                                void* flat, int pack, double scale, cudaStream_t stream) {
  if (nseg <= 0 || total_blocks == 0) return cudaSuccess;
  if (total_blocks > 0x7fffffffull) return cudaErrorInvalidConfiguration;
  cudaError_t rc = cudaErrorInvalidValue;
  with_dtype(src, [&](auto s) {
    with_dtype(dst, [&](auto d) {
      rc = launch(multi_tensor_kernel<decltype(s), decltype(d)>, static_cast<unsigned>(total_blocks), kThreads, stream,
                  segs, nseg, flat, pack, scale);
    });
  });
  return rc;
}

// CUB checks its launches with cudaPeekAtLastError: it answers an error the caller left pending as its
// own. The device does not call it while one is pending (CudaDevice::pack).
cudaError_t batched_copy(void* temp, size_t* temp_bytes, void* const* in, void* const* out, const size_t* sizes, int n,
                         cudaStream_t stream) {
  return cub::DeviceMemcpy::Batched(temp, *temp_bytes, in, out, sizes, n, stream);
}

cudaError_t launch_scale(void* buf, size_t n, ddp_dtype_t dtype, double scale, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  cudaError_t rc = cudaErrorInvalidValue;
  with_dtype(dtype, [&](auto t) {
    typedef decltype(t) T;
    rc = launch(scale_kernel<T>, grid_for(n), kThreads, stream, static_cast<typename T::storage*>(buf), n, scale);
  });
  return rc;
}

cudaError_t launch_nonfinite(const void* buf, size_t n, ddp_dtype_t dtype, unsigned* flag, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  cudaError_t rc = cudaErrorInvalidValue;
  with_dtype(dtype, [&](auto t) {
    typedef decltype(t) T;
    rc = launch(nonfinite_kernel<T>, grid_for(n), kThreads, stream, static_cast<const typename T::storage*>(buf), n,
                flag);
  });
  return rc;
}

cudaError_t launch_norm(const void* buf, size_t n, ddp_dtype_t dtype, double* partials, unsigned* blocks,
                        cudaStream_t stream) {
  *blocks = 0;
  if (n == 0) return cudaSuccess;
  cudaError_t rc = cudaErrorInvalidValue;
  with_dtype(dtype, [&](auto t) {
    typedef decltype(t) T;
    *blocks = grid_for(n);
    rc = launch(norm_kernel<T>, *blocks, kThreads, stream, static_cast<const typename T::storage*>(buf), n, partials);
  });
  return rc;
}

}  // namespace kern
}  // namespace ddp
