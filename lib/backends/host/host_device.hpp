// The host device: host memory, element work done by the calling thread, and streams that are
// worker threads running their tasks in order (so that a bucket's pack, collective and unpack run off
// the trainer's thread while backward goes on).
#pragma once

#include "core/backend.hpp"

namespace ddp {

class HostDevice final : public Device {
 public:
  Memory memory() const override { return Memory::Host; }
  void* alloc(size_t bytes) override;
  void free(void* p) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  std::unique_ptr<Stream> make_stream(int index) override;
  void stream_wait_user(Stream&, void*) override {}
  void user_wait_stream(void*, Stream&) override {}
  void pack(SegmentTable& table, Dtype src, void* dst, Dtype wire, double scale, Stream& s) override;
  void unpack(const void* src, Dtype wire, SegmentTable& table, Dtype dst, double scale,
              Stream& s) override;
  void scale(void* buf, size_t n, Dtype d, double scale, Stream& s) override;
  void fill_zero(void* buf, size_t n, Dtype d, Stream& s) override;
  bool has_nonfinite(const void* buf, size_t n, Dtype d, Stream& s) override;
};

// The element loops themselves, for unit tests and for the other host code that needs them.
namespace host {
void convert(const void* src, Dtype s, void* dst, Dtype d, size_t n, double scale);
bool has_nonfinite(const void* buf, size_t n, Dtype d);
}  // namespace host

}  // namespace ddp
