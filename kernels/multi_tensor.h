// Host-side entry points of the CUDA kernels: the multi-tensor scaled cast of a bucket (pack and
// unpack in one launch each), batched plain copies through CUB, in-place scaling and the NaN/Inf scan.
// Each returns its launch's own cudaError_t and leaves an error the caller has not read yet alone;
// the caller checks it. Nothing here knows about buckets.
// Defined by multi_tensor.cu on a GPU build and by tests/gpusim/kernels_sim.cpp in the simulated
// one; both run the thread bodies of kernel_bodies.h.
#pragma once

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp.h"
#include "kernel_bodies.h"

namespace ddp {
namespace kern {

// pack != 0: flat[seg.offset + i] = dst(seg.ptr[i] * scale) (zero for zero segments), seg.ptr is of
// type `src`, flat of type `dst`. pack == 0: seg.ptr[i] = dst(flat[seg.offset + i] * scale), flat is of
// type `src`. `total_blocks` is the sum of every segment's block count.
cudaError_t launch_multi_tensor(const SegDesc* segs, int nseg, uint64_t total_blocks, ddp_dtype_t src, ddp_dtype_t dst,
                                void* flat, int pack, double scale, cudaStream_t stream);

// cub::DeviceMemcpy::Batched. With temp == NULL only sets *temp_bytes (the two-phase query). CUB
// answers the thread's last error after its launch: an error already pending is returned as its own.
cudaError_t batched_copy(void* temp, size_t* temp_bytes, void* const* in, void* const* out, const size_t* sizes, int n,
                         cudaStream_t stream);

// buf[i] = dtype(buf[i] * scale).
cudaError_t launch_scale(void* buf, size_t n, ddp_dtype_t dtype, double scale, cudaStream_t stream);

// Sets *flag (device memory) to 1 if buf holds a NaN or Inf; leaves it alone otherwise.
cudaError_t launch_nonfinite(const void* buf, size_t n, ddp_dtype_t dtype, unsigned* flag, cudaStream_t stream);

// The norm's terms of buf, per block: partials[2 * b] is block b's sum of squares of finite elements
// (float64), partials[2 * b + 1] its count of NaN and Inf; *blocks (host) says how many blocks ran,
// at most kNormMaxBlocks, so partials (device memory) needs 2 * kNormMaxBlocks doubles.
constexpr unsigned kNormMaxBlocks = 4096;
cudaError_t launch_norm(const void* buf, size_t n, ddp_dtype_t dtype, double* partials, unsigned* blocks,
                        cudaStream_t stream);

// The int8 wire: quantizes n elements of x (f32 or f64) plus `residual` (n floats, updated) into
// `chunk` (elem::int8_chunk_bytes(n) bytes); and out = the rank-order sum of `world` chunks.
cudaError_t launch_int8_quantize(const void* x, ddp_dtype_t dtype, size_t n, float* residual, void* chunk,
                                 cudaStream_t stream);
cudaError_t launch_int8_dequant(const void* chunks, size_t chunk_bytes, int world, size_t n, ddp_dtype_t dtype,
                                void* out, cudaStream_t stream);

}  // namespace kern
}  // namespace ddp
