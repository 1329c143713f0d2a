// The kernel entry points of kernels/multi_tensor.h on the simulated runtime: each launch is
// enqueued on its stream and, when the stream gets there, runs every thread of the same grid as the
// CUDA launch (multi_tensor.cu) through the same thread bodies (kernels/kernel_bodies.h). Arguments
// are captured at launch, as a kernel's are; the memory they point to is read when the grid runs.
// Every pointer a kernel dereferences must be device memory of the stream's device, or the device
// faults (sticky cudaErrorIllegalAddress), as a GPU would.
#include <string>
#include <vector>

#include "gpusim.h"
#include "kernels/multi_tensor.h"

namespace ddp {
namespace kern {

namespace {

bool on_device(const void* p, size_t bytes, int device) {
  int d = -1;
  return bytes == 0 || (gpusim::device_range(p, bytes, &d) && d == device);
}

void check(bool ok, int device, const std::string& what) {
  if (!ok) gpusim::fault(device, what.c_str());
}

}  // namespace

cudaError_t launch_multi_tensor(const SegDesc* segs, int nseg, uint64_t total_blocks, ddp_dtype_t src, ddp_dtype_t dst,
                                void* flat, int pack, double scale, cudaStream_t stream) {
  if (nseg <= 0 || total_blocks == 0) return cudaSuccess;
  if (total_blocks > 0x7fffffffull) return cudaErrorInvalidConfiguration;
  const int device = gpusim::stream_device(stream);
  if (device < 0) return cudaErrorInvalidResourceHandle;
  cudaError_t rc = cudaErrorInvalidValue;
  with_dtype(src, [&](auto s) {
    with_dtype(dst, [&](auto d) {
      typedef decltype(s) S;
      typedef decltype(d) D;
      rc = gpusim::enqueue(stream, [=] {
        if (!on_device(segs, sizeof(SegDesc) * static_cast<size_t>(nseg), device))
          return check(false, device, "multi-tensor kernel: the segment table is not device memory");
        // Each segment's range, as its blocks will touch it (an upload that had not landed yet shows
        // up here as a table of garbage).
        for (int i = 0; i < nseg; ++i) {
          const SegDesc& g = segs[i];
          const size_t in_bytes = g.numel * sizeof(typename S::storage);
          const size_t out_bytes = g.numel * sizeof(typename D::storage);
          const bool flat_ok =
              pack ? on_device(static_cast<char*>(flat) + g.offset * sizeof(typename D::storage), out_bytes, device)
                   : on_device(static_cast<char*>(flat) + g.offset * sizeof(typename S::storage), in_bytes, device);
          const bool seg_ok = (pack && g.zero) || on_device(g.ptr, pack ? in_bytes : out_bytes, device);
          if (!flat_ok || !seg_ok)
            return check(false, device, "multi-tensor kernel: segment " + std::to_string(i) + " is out of bounds");
        }
        for (uint64_t b = 0; b < total_blocks; ++b)
          for (unsigned t = 0; t < static_cast<unsigned>(kThreads); ++t)
            multi_tensor_thread<S, D>(segs, nseg, flat, pack, scale, b, t, kThreads);
      });
    });
  });
  return rc;
}

// CUB's batched copy, as its documented contract: the first call (temp == nullptr) sizes the
// temporary storage; the second copies sizes[i] bytes from in[i] to out[i], the three arrays read
// from device memory when the copy runs. Its result is CUB's: the thread's last error after the launch.
cudaError_t batched_copy(void* temp, size_t* temp_bytes, void* const* in, void* const* out, const size_t* sizes, int n,
                         cudaStream_t stream) {
  const size_t need = 256 + 16 * static_cast<size_t>(n > 0 ? n : 0);
  if (!temp) {
    *temp_bytes = need;
    return cudaSuccess;
  }
  if (*temp_bytes < need) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  const int device = gpusim::stream_device(stream);
  if (device < 0) return cudaErrorInvalidResourceHandle;
  const cudaError_t rc = gpusim::enqueue(stream, [=] {
    const size_t arr = sizeof(void*) * static_cast<size_t>(n);
    if (!on_device(temp, need, device) || !on_device(in, arr, device) || !on_device(out, arr, device) ||
        !on_device(sizes, sizeof(size_t) * static_cast<size_t>(n), device))
      return check(false, device, "batched copy: its arrays or temporary storage are not device memory");
    for (int i = 0; i < n; ++i)
      if (!on_device(in[i], sizes[i], device) || !on_device(out[i], sizes[i], device))
        return check(false, device, "batched copy: buffer " + std::to_string(i) + " is out of bounds");
    for (int i = 0; i < n; ++i) memcpy(out[i], in[i], sizes[i]);
  });
  // As CUB does after its launches (triple_chevron: cudaPeekAtLastError): an error the caller left
  // pending on this thread is answered as the copy's own.
  return rc != cudaSuccess ? rc : cudaPeekAtLastError();
}

// The frame every grid-stride kernel shares: the stream's device, the dtype dispatch and the grid;
// kernel(T{}, grid, device) returns what the stream runs.
template <class K>
cudaError_t launch_grid(size_t n, ddp_dtype_t dtype, cudaStream_t stream, K kernel) {
  if (n == 0) return cudaSuccess;
  const int device = gpusim::stream_device(stream);
  if (device < 0) return cudaErrorInvalidResourceHandle;
  cudaError_t rc = cudaErrorInvalidValue;
  with_dtype(dtype, [&](auto t) { rc = gpusim::enqueue(stream, kernel(t, grid_for(n), device)); });
  return rc;
}

cudaError_t launch_scale(void* buf, size_t n, ddp_dtype_t dtype, double scale, cudaStream_t stream) {
  return launch_grid(n, dtype, stream, [=](auto t, size_t grid, int device) {
    typedef decltype(t) T;
    return [=] {
      typename T::storage* p = static_cast<typename T::storage*>(buf);
      if (!on_device(p, n * sizeof *p, device)) return check(false, device, "scale kernel: buffer out of bounds");
      for (size_t b = 0; b < grid; ++b)
        for (size_t th = 0; th < static_cast<size_t>(kThreads); ++th)
          scale_thread<T>(p, n, scale, b, th, kThreads, grid);
    };
  });
}

cudaError_t launch_nonfinite(const void* buf, size_t n, ddp_dtype_t dtype, unsigned* flag, cudaStream_t stream) {
  return launch_grid(n, dtype, stream, [=](auto t, size_t grid, int device) {
    typedef decltype(t) T;
    return [=] {
      const typename T::storage* p = static_cast<const typename T::storage*>(buf);
      if (!on_device(p, n * sizeof *p, device) || !on_device(flag, sizeof *flag, device))
        return check(false, device, "nonfinite kernel: buffer or flag out of bounds");
      for (size_t b = 0; b < grid; ++b) {
        bool any = false;  // __syncthreads_or over the block
        for (size_t th = 0; th < static_cast<size_t>(kThreads); ++th)
          any |= nonfinite_thread<T>(p, n, b, th, kThreads, grid);
        if (any) *flag = 1u;  // thread 0's store
      }
    };
  });
}

cudaError_t launch_int8_quantize(const void* x, ddp_dtype_t dtype, size_t n, float* residual, void* chunk,
                                 cudaStream_t stream) {
  const size_t nblocks = elem::int8_blocks(n);
  return launch_grid(nblocks, dtype, stream, [=](auto t, size_t grid, int device) {
    typedef decltype(t) T;
    return [=] {
      const typename T::storage* p = static_cast<const typename T::storage*>(x);
      if (!on_device(p, n * sizeof *p, device) || !on_device(residual, n * sizeof(float), device) ||
          !on_device(chunk, elem::int8_chunk_bytes(n), device))
        return check(false, device, "int8 quantize kernel: a buffer out of bounds");
      for (size_t b = 0; b < grid; ++b)
        for (size_t th = 0; th < static_cast<size_t>(kThreads); ++th)
          int8_quantize_thread<T>(p, residual, n, static_cast<char*>(chunk), b, th, kThreads, grid);
    };
  });
}

cudaError_t launch_int8_dequant(const void* chunks, size_t chunk_bytes, int world, size_t n, ddp_dtype_t dtype,
                                void* out, cudaStream_t stream) {
  return launch_grid(n, dtype, stream, [=](auto t, size_t grid, int device) {
    typedef decltype(t) T;
    return [=] {
      typename T::storage* o = static_cast<typename T::storage*>(out);
      if (!on_device(chunks, chunk_bytes * static_cast<size_t>(world), device) || !on_device(o, n * sizeof *o, device))
        return check(false, device, "int8 dequant kernel: a buffer out of bounds");
      for (size_t b = 0; b < grid; ++b)
        for (size_t th = 0; th < static_cast<size_t>(kThreads); ++th)
          int8_dequant_thread<T>(static_cast<const char*>(chunks), chunk_bytes, world, n, o, b, th, kThreads, grid);
    };
  });
}

cudaError_t launch_norm(const void* buf, size_t n, ddp_dtype_t dtype, double* partials, unsigned* blocks,
                        cudaStream_t stream) {
  *blocks = n ? grid_for(n) : 0;
  return launch_grid(n, dtype, stream, [=](auto t, size_t grid, int device) {
    typedef decltype(t) T;
    return [=] {
      const typename T::storage* p = static_cast<const typename T::storage*>(buf);
      if (!on_device(p, n * sizeof *p, device) || !on_device(partials, 2 * grid * sizeof(double), device))
        return check(false, device, "norm kernel: buffer or partials out of bounds");
      std::vector<double> sq(kThreads), bad(kThreads);  // the block's shared memory
      for (size_t b = 0; b < grid; ++b) {
        for (size_t th = 0; th < static_cast<size_t>(kThreads); ++th)
          norm_thread<T>(p, n, b, th, kThreads, grid, &sq[th], &bad[th]);
        for (size_t half = kThreads / 2; half > 0; half /= 2)
          for (size_t th = 0; th < half; ++th) {
            tree_step(sq.data(), th, half);
            tree_step(bad.data(), th, half);
          }
        partials[2 * b] = sq[0];
        partials[2 * b + 1] = bad[0];
      }
    };
  });
}

}  // namespace kern
}  // namespace ddp
