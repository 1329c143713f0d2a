// The host device: host memory, element work done by the calling thread, and streams that are
// worker threads running their tasks in order (so that a bucket's pack, collective and unpack run off
// the trainer's thread while backward goes on).
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "host/host_kernels.hpp"
#include "core/backend.hpp"

namespace ddp {

struct WorkerState;

class HostDevice final : public Device {
 public:
  HostDevice();
  // Host memory (buffers a written-off worker may still write are kept until exit), worker streams.
  Memory memory() const override { return Memory::Host; }
  void* alloc(size_t bytes) override;
  void free(void* p) override;
  void release(void* p) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  std::unique_ptr<Stream> make_stream(int index) override;
  // Grads are final when marked ready: nothing to order with the user's stream.
  void stream_wait_user(Stream&, void*) override {}
  void user_wait_stream(void*, Stream&) override {}
  // Element work, done now by the calling thread (a stream's worker when a bucket runs): no stream
  // argument is used.
  void pack(SegmentTable& table, Dtype src, void* dst, Dtype wire, double scale, Span span, Stream&) override;
  void unpack(const void* src, Dtype wire, SegmentTable& table, Dtype dst, double scale, Span span, Stream&) override;
  void scale(void* buf, size_t n, Dtype d, double scale, Stream&) override;
  void fill_zero(void* buf, size_t n, Dtype d, Stream&) override;
  // Finiteness flags: one atomic per slot, set by the scan, read and cleared by take_nonfinite.
  void reserve_flags(size_t slots) override;
  void scan_nonfinite(const void* buf, size_t n, Dtype d, size_t slot, Stream&) override;
  bool take_nonfinite(size_t slot, Stream&) override;
  void norm_terms(const void* buf, size_t n, Dtype d, Stream&, double out[2]) override;
  void int8_quantize(const void* x, Dtype d, size_t n, float* residual, void* chunk, Stream&) override {
    host::int8_quantize(x, d, n, residual, chunk);
  }
  void int8_dequant_sum(const void* chunks, size_t chunk_bytes, int world, size_t n, Dtype d, void* out,
                        Stream&) override {
    host::int8_dequant_sum(chunks, chunk_bytes, world, n, d, out);
  }
  // A tile of the span at a time (packed into the stack, quantized from there, or straight from a
  // grad that holds it unscaled; summed there, unpacked from there), so the packed values stay in L1.
  void int8_quantize_grads(SegmentTable& table, Dtype d, double pre, Span span, float* residual, void* chunk,
                           Stream&) override;
  void int8_dequant_grads(const void* chunks, size_t chunk_bytes, int world, Span span, SegmentTable& table, Dtype d,
                          double post, Stream&) override;

 private:
  // Set by a stream of this device that wrote off a worker blocked in a collective.
  std::shared_ptr<std::atomic<bool>> abandoned_;
  std::unique_ptr<std::atomic<bool>[]> flags_;
  size_t nflags_ = 0;
};

namespace host {
// Keeps `p` alive until the process exits: the one registry of host memory that a collective which
// could not be cancelled may still write (never freed, reachable, so no leak report).
void keep_until_exit(std::shared_ptr<void> p);

// Brackets a call that may block for good (an MPI collective whose peer died). On a host stream's
// worker, a drain that times out may write the worker off while it is inside; if the call returns
// after that, the destructor parks the thread for good instead of returning into state that may be
// freed by then. Off a stream worker, `on_worker()` is false: the caller must keep its deadline itself.
class BlockingCall {
 public:
  BlockingCall();
  ~BlockingCall();
  BlockingCall(const BlockingCall&) = delete;
  BlockingCall& operator=(const BlockingCall&) = delete;
  bool on_worker() const { return state_ != nullptr; }

 private:
  WorkerState* state_;
};

// Whether a stream of this process has written off a worker (its task did not finish by its
// deadline): a thread that may still be inside a collective, so the communication library must not
// be shut down under it (the MPI backend then skips its MPI_Finalize at exit).
bool any_written_off();

// Bytes per collective piece on host memory: DDP_HOST_PIECE_BYTES, else 4 MiB (docs/performance.md).
size_t piece_bytes();
}  // namespace host

}  // namespace ddp
