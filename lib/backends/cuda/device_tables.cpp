// Segment tables on the CUDA device: the check that every grad is memory the device can use, and the
// upload of a table's descriptors (from a pinned image, in stream order) when the table changes.
#include "backends/cuda/device_tables.hpp"

#include <cstring>

namespace ddp {

static const char* memory_kind(cudaMemoryType t) {
  switch (t) {
    case cudaMemoryTypeHost: return "pinned host memory";
    case cudaMemoryTypeDevice: return "device memory";
    case cudaMemoryTypeManaged: return "managed memory";
    default: return "pageable host memory (or not an allocation at all)";
  }
}

// A grad that the GPU cannot read would fault the kernel and poison the whole CUDA context: every
// pointer is checked instead, once per table version.
void CudaDevice::check_pointers(const SegmentTable& table) const {
  for (size_t i = 0; i < table.segs.size(); ++i) {
    const Segment& seg = table.segs[i];
    cudaPointerAttributes attr;
    std::memset(&attr, 0, sizeof attr);
    cudaError_t rc = cudaPointerGetAttributes(&attr, seg.ptr);
    if (rc != cudaSuccess) cudaGetLastError();
    const bool ok = rc == cudaSuccess && ((attr.type == cudaMemoryTypeDevice && attr.device == device_) ||
                                          attr.type == cudaMemoryTypeManaged ||
                                          (attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr));
    if (ok) continue;
    if (rc == cudaSuccess && attr.type == cudaMemoryTypeDevice)
      fail(DDP_ERR_CUDA,
           "grad storage %p (segment %zu of a bucket) is device memory of CUDA device %d, but the "
           "communicator runs on device %d",
           seg.ptr, i, attr.device, device_);
    fail(DDP_ERR_CUDA,
         "grad storage %p (segment %zu of a bucket) is not memory CUDA device %d can use: it is %s. An NCCL "
         "communicator needs device pointers",
         seg.ptr, i, device_, rc == cudaSuccess ? memory_kind(attr.type) : cudaGetErrorString(rc));
  }
}

// Device storage for a table of `n` segments, and CUB's temporary storage sized by its query.
void CudaDevice::TableState::reserve(size_t count, CudaStream& s) {
  if (n == count && dev) return;
  if (pending) s.wait_event(uploaded);  // the old host image is still to be read
  pending = false;
  cudaFreeHost(host);
  host = nullptr;
  cudaFree(dev);
  dev = nullptr;
  cudaFree(temp);
  temp = nullptr;
  n = count;
  DDP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev), size()));
  size_t need = 0;
  DDP_CUDA_CHECK(kern::batched_copy(nullptr, &need, grads(), flats(), bytes(), static_cast<int>(n), s.stream()));
  temp_bytes = need ? need : 1;
  DDP_CUDA_CHECK(cudaMalloc(&temp, temp_bytes));
  DDP_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host), size()));
  if (!uploaded) DDP_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming));
}

// Fills the host image of the table (kernel descriptors, CUB's arrays) and uploads it on `stream`.
void CudaDevice::TableState::upload(const SegmentTable& table, const void* flat_buf, size_t elem, CudaStream& s) {
  if (pending) s.wait_event(uploaded);  // the previous upload must have read the image we rewrite
  pending = false;
  kern::SegDesc* hs = reinterpret_cast<kern::SegDesc*>(host);
  void** hg = reinterpret_cast<void**>(host + n * sizeof(kern::SegDesc));
  void** hf = hg + n;
  size_t* hb = reinterpret_cast<size_t*>(hf + n);
  uint64_t blocks = 0;
  bool zero = false;
  for (size_t i = 0; i < n; ++i) {
    const Segment& seg = table.segs[i];
    hs[i] = kern::SegDesc{seg.ptr, seg.offset, seg.numel, blocks, seg.zero, 0};
    blocks += kern::blocks_for(seg.numel);
    zero = zero || seg.zero != 0;
    hg[i] = seg.ptr;
    hf[i] = static_cast<char*>(const_cast<void*>(flat_buf)) + seg.offset * elem;
    hb[i] = seg.numel * elem;
  }
  if (blocks > 0x7fffffffull) fail(DDP_ERR_UNSUPPORTED, "a bucket of %zu grads is too large for one kernel launch", n);
  // Pinned source: a true asynchronous copy, read in stream order (a pageable one would be staged
  // synchronously by the runtime).
  DDP_CUDA_CHECK(cudaMemcpyAsync(dev, host, size(), cudaMemcpyHostToDevice, s.stream()));
  DDP_CUDA_CHECK(cudaEventRecord(uploaded, s.stream()));
  pending = true;
  version = table.version;
  flat = flat_buf;
  flat_elem = elem;
  any_zero = zero;
  total_blocks = blocks;
  valid = true;
}

CudaDevice::TableState& CudaDevice::prepare(SegmentTable& table, const void* flat, size_t flat_elem, CudaStream& s) {
  TableState* st = static_cast<TableState*>(table.device_state.get());
  if (!st) {
    std::shared_ptr<TableState> fresh = std::make_shared<TableState>();
    fresh->device = device_;
    fresh->abandoned = s.abandoned();
    table.device_state = fresh;
    st = fresh.get();
  }
  if (st->valid && st->version == table.version && st->flat == flat && st->flat_elem == flat_elem) return *st;
  check_pointers(table);
  st->reserve(table.segs.size(), s);
  st->upload(table, flat, flat_elem, s);
  ++uploads_;
  return *st;
}

}  // namespace ddp
