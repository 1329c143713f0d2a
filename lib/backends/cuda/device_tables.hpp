// Segment tables on the CUDA device: what the bucket kernels and CUB's batched copy read to find a
// bucket's grads, uploaded once per table version (device_tables.cpp) and used by the launches
// (cuda_launches.cpp).
#pragma once

#include <atomic>
#include <memory>

#include "backends/cuda/cuda_device.hpp"
#include "kernels/multi_tensor.h"

namespace ddp {

// What a SegmentTable looks like on the device: the multi-tensor kernel's descriptors and CUB's pointer
// and size arrays, all in one allocation, uploaded again only when the table's version, the flat
// buffer or its element size changes. CUB's temporary storage is sized once, by its query.
struct CudaDevice::TableState {
  int device = 0;
  uint64_t version = 0;
  const void* flat = nullptr;
  size_t flat_elem = 0;
  bool valid = false;
  size_t n = 0;
  bool any_zero = false;
  uint64_t total_blocks = 0;
  char* dev = nullptr;  // kern::SegDesc[n] | void* grads[n] | void* flats[n] | size_t bytes[n]
  void* temp = nullptr;
  size_t temp_bytes = 0;
  char* host = nullptr;            // pinned: the upload reads it when the stream gets there, not at the call
  cudaEvent_t uploaded = nullptr;  // recorded after the latest upload: `host` is free again after it
  bool pending = false;            // an upload was recorded and may not have run yet
  std::shared_ptr<std::atomic<bool>> abandoned;  // the device's streams wrote work off: keep the memory

  void reserve(size_t count, CudaStream& s);
  void upload(const SegmentTable& table, const void* flat_buf, size_t elem, CudaStream& s);
  kern::SegDesc* segs() const { return reinterpret_cast<kern::SegDesc*>(dev); }
  void** grads() const { return reinterpret_cast<void**>(dev + n * sizeof(kern::SegDesc)); }
  void** flats() const { return grads() + n; }
  size_t* bytes() const { return reinterpret_cast<size_t*>(flats() + n); }
  size_t size() const { return n * (sizeof(kern::SegDesc) + 2 * sizeof(void*) + sizeof(size_t)); }

  // cudaFree waits for the kernels queued before that may still read the table. After a stream wrote
  // work off, a kernel may never finish (a borrowed communicator libddp cannot abort): the table's
  // memory is then kept rather than waited for.
  ~TableState() {
    if (abandoned && abandoned->load()) return;
    DeviceGuard g(device, true);
    cudaFree(dev);
    cudaFree(temp);
    cudaFreeHost(host);
    if (uploaded) cudaEventDestroy(uploaded);
  }
};

}  // namespace ddp
