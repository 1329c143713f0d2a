#include "backends/cuda/cuda_device.hpp"

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>

#include "kernels/multi_tensor.h"

namespace ddp {

void cuda_fail(cudaError_t rc, const char* call, const char* file, int line) {
  cudaGetLastError();  // clear a non-sticky error so that later calls do not see it again
  const char* base = std::strrchr(file, '/');
  fail(rc == cudaErrorMemoryAllocation ? DDP_ERR_OUT_OF_MEMORY : DDP_ERR_CUDA, "%s failed: %s (%s) at %s:%d", call,
       cudaGetErrorName(rc), cudaGetErrorString(rc), base ? base + 1 : file, line);
}

int require_cuda_device(int device) {
  int n = 0;
  cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    const char* why = rc == cudaErrorNoDevice ? "no CUDA device is visible to this process"
                      : rc == cudaErrorInsufficientDriver
                          ? "no usable CUDA driver, so no CUDA device (no GPU driver is installed, or it is older "
                            "than the CUDA runtime libddp was built with)"
                          : "no CUDA device is usable";
    fail(DDP_ERR_CUDA, "%s: cudaGetDeviceCount failed with %s (%s)", why, cudaGetErrorName(rc), cudaGetErrorString(rc));
  }
  if (n <= 0) fail(DDP_ERR_CUDA, "no CUDA device is visible to this process (cudaGetDeviceCount found 0)");
  if (device >= n)
    fail(DDP_ERR_INVALID_ARGUMENT, "CUDA device %d does not exist: %d device%s visible (0..%d)", device, n,
         n == 1 ? " is" : "s are", n - 1);
  return n;
}

namespace {

// The driver's current-context calls, found through the runtime (no link to libcuda): the runtime
// alone cannot tell "device 0 is current" from "nothing was ever made current on this thread".
struct CtxApi {
  int (*get)(void** ctx) = nullptr;
  int (*set)(void* ctx) = nullptr;
};

const CtxApi& ctx_api() {
  static const CtxApi a = [] {
    CtxApi x;
    const cudaError_t before = cudaPeekAtLastError();
    void *get = nullptr, *set = nullptr;
    cudaDriverEntryPointQueryResult qg = cudaDriverEntryPointSymbolNotFound, qs = qg;
    const bool ok =
        cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 12000, cudaEnableDefault, &qg) == cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 12000, cudaEnableDefault, &qs) == cudaSuccess &&
        qg == cudaDriverEntryPointSuccess && qs == cudaDriverEntryPointSuccess;
    if (ok) {
      x.get = reinterpret_cast<int (*)(void**)>(get);
      x.set = reinterpret_cast<int (*)(void*)>(set);
    } else if (before == cudaSuccess) {
      cudaGetLastError();  // our failed lookup only: a pending error of the caller's stays
    }
    return x;
  }();
  return a;
}

}  // namespace

DeviceGuard::DeviceGuard(int device) : device_(device) {
  void* ctx = nullptr;
  if (ctx_api().get && ctx_api().get(&ctx) == 0) had_context_ = ctx != nullptr;
  DDP_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device_ || !had_context_) DDP_CUDA_CHECK(cudaSetDevice(device_));
}

DeviceGuard::DeviceGuard(int device, bool) : device_(device) {
  void* ctx = nullptr;
  if (ctx_api().get && ctx_api().get(&ctx) == 0) had_context_ = ctx != nullptr;
  if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
  if (prev_ != device_ || !had_context_) cudaSetDevice(device_);
}

DeviceGuard::~DeviceGuard() {
  // A destructor cannot throw, and there is nothing to undo if the switch back fails.
  if (!had_context_)
    ctx_api().set(nullptr);  // as the caller had it: no context, none created on GPU 0
  else if (prev_ >= 0 && prev_ != device_)
    cudaSetDevice(prev_);
}

void refuse_capture(void* user_stream, const char* where) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DDP_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(user_stream), &capture));
  if (capture != cudaStreamCaptureStatusNone)
    fail(DDP_ERR_UNSUPPORTED,
         "%s: the stream is being captured into a CUDA graph, and libddp cannot be captured: an iteration keeps "
         "state on the host (deadlines, finiteness flags, statistics) that a replayed graph would not update. "
         "Call libddp outside the captured region",
         where);
}

// ---------------------------------------------------------------------------------------------
// The watchdog
// ---------------------------------------------------------------------------------------------

namespace {

struct Watchdog {
  std::mutex mu;  // held while registering, unregistering and scanning
  std::vector<Watched*> items;
  bool started = false;

  void loop() {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::lock_guard<std::mutex> lock(mu);
      for (Watched* w : items) w->scan();
    }
  }
};

// Never destroyed: the thread runs until the process exits.
Watchdog& watchdog() {
  static Watchdog* w = new Watchdog();
  return *w;
}

}  // namespace

void watchdog_register(Watched* w) {
  Watchdog& d = watchdog();
  std::lock_guard<std::mutex> lock(d.mu);
  d.items.push_back(w);
  if (!d.started) {
    d.started = true;
    std::thread([&d] { d.loop(); }).detach();
  }
}

void watchdog_unregister(Watched* w) {
  Watchdog& d = watchdog();
  std::lock_guard<std::mutex> lock(d.mu);
  d.items.erase(std::remove(d.items.begin(), d.items.end(), w), d.items.end());
}

// ---------------------------------------------------------------------------------------------
// Streams
// ---------------------------------------------------------------------------------------------

CudaStream::CudaStream(int device, int index) : device_(device), index_(index) {
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  DDP_CUDA_CHECK(cudaEventCreateWithFlags(&in_event_, cudaEventDisableTiming));
  DDP_CUDA_CHECK(cudaEventCreateWithFlags(&out_event_, cudaEventDisableTiming));
  watchdog_register(this);
}

CudaStream::~CudaStream() {
  watchdog_unregister(this);
  // Resources of a stream with work still queued are released when that work completes.
  DeviceGuard g(device_, true);
  for (const Mark& m : marks_) cudaEventDestroy(m.event);
  for (cudaEvent_t e : spare_) cudaEventDestroy(e);
  if (in_event_) cudaEventDestroy(in_event_);
  if (out_event_) cudaEventDestroy(out_event_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaStream::submit(Task* task) {
  if (cancelled_) return;
  DeviceGuard g(device_);
  task->run();
}

// Inside an NCCL group the collective is only enqueued at the group's end, so no event is recorded
// here: its deadline waits for the next mark (finishes_later), recorded after the group.
void CudaStream::watch(AsyncErrorSource* src, Deadline dl) {
  std::lock_guard<std::mutex> lock(mu_);
  bool known = false;
  for (AsyncErrorSource* s : sources_) known = known || s == src;
  if (!known) sources_.push_back(src);  // a handful per stream, added on first use only
  if (!dl.infinite() && (!has_unmarked_ || dl.at() < unmarked_.at())) {
    unmarked_ = dl;  // the oldest: later work must not hide a collective stuck before it
    has_unmarked_ = true;
  }
}

bool CudaStream::finishes_later(int tag, std::atomic<int32_t>* done) {
  cudaEvent_t e = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!spare_.empty()) {
      e = spare_.back();
      spare_.pop_back();
    }
  }
  DeviceGuard g(device_);
  if (!e) DDP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));  // until the pool is large enough
  const cudaError_t rc = cudaEventRecord(e, stream_);
  std::lock_guard<std::mutex> lock(mu_);
  if (rc != cudaSuccess) {
    spare_.push_back(e);
    DDP_CUDA_CHECK(rc);
  }
  marks_.push_back(Mark{e, unmarked_, has_unmarked_, tag, done});
  has_unmarked_ = false;
  return true;
}

// The newest mark of `tag` is this iteration's (a bucket's tag is its index, the same every
// iteration); one no longer held has completed. The wait captures the event's state when enqueued,
// so a later reuse of the event does not move it.
void CudaStream::user_wait_tag(void* user_stream, int tag) {
  DeviceGuard g(device_);
  refuse_capture(user_stream, "ddp_wait_grad");
  std::lock_guard<std::mutex> lock(mu_);
  for (auto m = marks_.rbegin(); m != marks_.rend(); ++m)
    if (m->tag == tag) {
      DDP_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(user_stream), m->event, 0));
      return;
    }
}

// Once the stream is late, the abort has released its stuck work, whose marks then complete: the
// bucket to name is the one found late, not the oldest mark still pending.
int CudaStream::oldest_unfinished() {
  std::lock_guard<std::mutex> lock(mu_);
  if (late_) return late_tag_;
  late_locked(false);
  return marks_.empty() ? -1 : marks_.front().tag;
}

// Sets late_tag_ to the bucket of the late work (-1: work enqueued after the last mark).
bool CudaStream::late_locked(bool stream_idle) {
  if (late_) return true;  // aborted work completing is not a bucket done
  while (!marks_.empty() && (stream_idle || cudaEventQuery(marks_.front().event) == cudaSuccess)) {
    marks_.front().done->fetch_add(1, std::memory_order_relaxed);
    spare_.push_back(marks_.front().event);
    marks_.pop_front();
  }
  if (stream_idle) has_unmarked_ = false;
  for (const Mark& m : marks_)
    if (m.has_deadline && m.deadline.passed()) {
      late_tag_ = marks_.front().tag;  // the oldest unfinished: work before a late mark is stuck too
      return true;
    }
  late_tag_ = marks_.empty() ? -1 : marks_.front().tag;
  return has_unmarked_ && unmarked_.passed() && cudaStreamQuery(stream_) == cudaErrorNotReady;
}

// The watchdog's check. Aborting releases the stuck kernels (and whoever waits on them); the sources
// abort every communicator split from the same parent at once, so none waits on a sibling's kernel.
void CudaStream::scan() {
  std::vector<AsyncErrorSource*> stuck;
  {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock() || late_ || cancelled_) return;
    DeviceGuard g(device_, true);
    if (!late_locked(false)) return;
    late_ = true;
    abandoned_->store(true);
    stuck = sources_;
  }
  for (AsyncErrorSource* s : stuck) s->mark_stalled();
}

void CudaStream::fail_late() {
  std::string who;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (AsyncErrorSource* s : sources_)
      if (who.empty()) who = s->who();
  }
  fail(DDP_ERR_TIMEOUT,
       "stream %d%s%s: a collective did not complete before the timeout: another rank stalled, died or issued a "
       "different collective; its communicators were aborted",
       index_, who.empty() ? "" : ", ", who.c_str());
}

bool CudaStream::idle() {
  std::vector<AsyncErrorSource*> srcs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    srcs = sources_;
  }
  if (late()) fail_late();
  for (AsyncErrorSource* s : srcs) s->check_async();
  // Querying a stream that is being captured into a graph would invalidate the capture.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DDP_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
  if (capture != cudaStreamCaptureStatusNone) return true;
  cudaError_t rc = cudaStreamQuery(stream_);
  if (rc == cudaSuccess) {
    // A collective that failed may have finished after the check above: its error must not be
    // mistaken for a clean finish (the grads it left are not reduced).
    for (AsyncErrorSource* s : srcs) s->check_async();
    std::lock_guard<std::mutex> lock(mu_);
    late_locked(true);
    return true;
  }
  if (rc != cudaErrorNotReady) DDP_CUDA_CHECK(rc);
  bool over = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    over = !late_ && late_locked(false);
    if (over) late_ = true, abandoned_->store(true);
  }
  if (over) {
    for (AsyncErrorSource* s : srcs) s->mark_stalled();
    fail_late();
  }
  return false;
}

bool CudaStream::late() {
  std::lock_guard<std::mutex> lock(mu_);
  return late_;
}

// Host waits for one event of this stream; the stream's own checks bound the wait.
void CudaStream::wait_event(cudaEvent_t e) {
  for (unsigned spin = 0;; ++spin) {
    const cudaError_t rc = cudaEventQuery(e);
    if (rc == cudaSuccess) return;
    if (rc != cudaErrorNotReady) DDP_CUDA_CHECK(rc);
    if (idle()) return;
    if (spin < 64)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void CudaStream::poll_error() {
  DeviceGuard g(device_);
  idle();
}

void CudaStream::drain(Deadline deadline) {
  DeviceGuard g(device_);
  const Deadline warn_at = Deadline::after_ms(stall_ms_);
  bool warned = stall_ms_ <= 0 || !stall_warn_;
  const bool watching = peer_ms_ > 0 && peer_check_;
  Deadline ask_at = Deadline::after_ms(peer_ms_);
  for (unsigned spin = 0; !idle(); ++spin) {
    if (deadline.passed()) fail(DDP_ERR_TIMEOUT, "stream %d: work still running at the deadline", index_);
    if (!warned && warn_at.passed()) {
      warned = true;
      stall_warn_();
    }
    if (watching && ask_at.passed()) {
      peer_check_();
      ask_at = Deadline::after_ms(peer_ms_);
    }
    if (spin < 64)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// ---------------------------------------------------------------------------------------------
// Segment tables on the device
// ---------------------------------------------------------------------------------------------

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

CudaStream& CudaDevice::cuda(Stream& s) const {
  CudaStream* c = dynamic_cast<CudaStream*>(&s);
  if (!c) fail(DDP_ERR_INTERNAL, "the CUDA device was given a stream it did not make");
  return *c;
}

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

// ---------------------------------------------------------------------------------------------
// The device
// ---------------------------------------------------------------------------------------------

CudaDevice::CudaDevice(int device) : device_(device) {
  require_cuda_device(device_);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_flag_), sizeof(unsigned)));
  DDP_CUDA_CHECK(cudaStreamCreateWithFlags(&setup_, cudaStreamNonBlocking));
}

CudaDevice::~CudaDevice() {
  DeviceGuard g(device_, true);
  if (!abandoned()) {  // else a kernel that never finishes may still write them: kept
    cudaFree(dev_flags_);
    cudaFreeHost(host_flag_);
    cudaFree(dev_partials_);
    cudaFreeHost(host_partials_);
  }
  for (cudaEvent_t e : marks_) cudaEventDestroy(e);
  if (setup_) cudaStreamDestroy(setup_);
}

bool CudaDevice::abandoned() const {
  for (const auto& a : abandoned_)
    if (a->load()) return true;
  return false;
}

void CudaDevice::zero_new(void* p, size_t bytes) {
  DDP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, setup_));
  DDP_CUDA_CHECK(cudaStreamSynchronize(setup_));  // only this memset is queued there: no deadline needed
}

void* CudaDevice::alloc(size_t bytes) {
  DeviceGuard g(device_);
  void* p = nullptr;
  cudaError_t rc = cudaMalloc(&p, bytes ? bytes : 1);
  if (rc == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    fail(DDP_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes on CUDA device %d", bytes, device_);
  }
  DDP_CUDA_CHECK(rc);
  try {
    zero_new(p, bytes ? bytes : 1);
  } catch (...) {
    cudaFree(p);
    throw;
  }
  return p;
}

void CudaDevice::free(void* p) {
  if (!p) return;
  // After a stream wrote work off, a kernel that never finishes may still write the buffer, and the
  // wait below would last forever (a borrowed communicator is never aborted by libddp): kept.
  if (abandoned()) return;
  DeviceGuard g(device_, true);
  // Work queued on any stream may still use the buffer: wait for it (frees happen only when a plan is
  // adopted or a context is destroyed). Failures cannot be reported from here.
  cudaDeviceSynchronize();
  cudaFree(p);
}

void CudaDevice::copy(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  DeviceGuard g(device_);
  // Called when the arena moves: the user's streams may still be writing the old storage, and the
  // copy must see their results, so the whole device is synchronized first (once per layout change).
  DDP_CUDA_CHECK(cudaDeviceSynchronize());
  DDP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
  DDP_CUDA_CHECK(cudaDeviceSynchronize());
}

std::unique_ptr<Stream> CudaDevice::make_stream(int index) {
  std::unique_ptr<CudaStream> s(new CudaStream(device_, index));
  abandoned_.push_back(s->abandoned());
  return std::unique_ptr<Stream>(s.release());
}

void CudaDevice::stream_wait_user(Stream& s, void* user_stream) {
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  refuse_capture(user_stream, "ddp_grad_ready");
  DDP_CUDA_CHECK(cudaEventRecord(c.in_event(), static_cast<cudaStream_t>(user_stream)));
  DDP_CUDA_CHECK(cudaStreamWaitEvent(c.stream(), c.in_event(), 0));
}

void CudaDevice::user_wait_stream(void* user_stream, Stream& s) {
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  refuse_capture(user_stream, "ddp_finish_backward");
  DDP_CUDA_CHECK(cudaEventRecord(c.out_event(), c.stream()));
  DDP_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(user_stream), c.out_event(), 0));
}

// Whether the calling thread holds a CUDA error nobody has read yet (the caller's, or a sticky one).
// CUB's batched copy would answer it as its own result (it checks its launch with
// cudaPeekAtLastError): the multi-tensor kernel, whose launch reports its own result, copies instead
// (a scale of 1 is a plain copy, bit for bit), and the error stays the caller's.
static bool error_pending() { return cudaPeekAtLastError() != cudaSuccess; }

// The GPU path reduces a bucket whole (NCCL cuts no pieces): a span is always the whole table.
static void require_whole(const SegmentTable& table, Span span) {
  const Segment& last = table.segs.back();
  if (span.lo != 0 || span.hi < last.offset + last.numel)
    fail(DDP_ERR_INTERNAL, "cuda device: pack/unpack of a part of a bucket");
}

void CudaDevice::pack(SegmentTable& table, Dtype src, void* dst, Dtype wire, double scale, Span span, Stream& s) {
  if (table.segs.empty()) return;
  require_whole(table, span);
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  TableState& st = prepare(table, dst, dtype_size(wire), c);
  if (src == wire && scale == 1.0 && !st.any_zero && !error_pending()) {
    size_t temp = st.temp_bytes;
    DDP_CUDA_CHECK(
        kern::batched_copy(st.temp, &temp, st.grads(), st.flats(), st.bytes(), static_cast<int>(st.n), c.stream()));
  } else {
    DDP_CUDA_CHECK(kern::launch_multi_tensor(st.segs(), static_cast<int>(st.n), st.total_blocks,
                                             static_cast<ddp_dtype_t>(src), static_cast<ddp_dtype_t>(wire), dst, 1,
                                             scale, c.stream()));
  }
}

void CudaDevice::unpack(const void* src, Dtype wire, SegmentTable& table, Dtype dst, double scale, Span span,
                        Stream& s) {
  if (table.segs.empty()) return;
  require_whole(table, span);
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  TableState& st = prepare(table, src, dtype_size(wire), c);
  if (wire == dst && scale == 1.0 && !error_pending()) {
    size_t temp = st.temp_bytes;
    DDP_CUDA_CHECK(
        kern::batched_copy(st.temp, &temp, st.flats(), st.grads(), st.bytes(), static_cast<int>(st.n), c.stream()));
  } else {
    DDP_CUDA_CHECK(kern::launch_multi_tensor(st.segs(), static_cast<int>(st.n), st.total_blocks,
                                             static_cast<ddp_dtype_t>(wire), static_cast<ddp_dtype_t>(dst),
                                             const_cast<void*>(src), 0, scale, c.stream()));
  }
}

void CudaDevice::scale(void* buf, size_t n, Dtype d, double scale, Stream& s) {
  if (scale == 1.0 || n == 0) return;
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(kern::launch_scale(buf, n, static_cast<ddp_dtype_t>(d), scale, c.stream()));
}

void CudaDevice::fill_zero(void* buf, size_t n, Dtype d, Stream& s) {
  if (n == 0) return;
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaMemsetAsync(buf, 0, n * dtype_size(d), c.stream()));
}

void CudaDevice::int8_quantize(const void* x, Dtype d, size_t n, float* residual, void* chunk, Stream& s) {
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(kern::launch_int8_quantize(x, static_cast<ddp_dtype_t>(d), n, residual, chunk, c.stream()));
}

void CudaDevice::int8_dequant_sum(const void* chunks, size_t chunk_bytes, int world, size_t n, Dtype d, void* out,
                                  Stream& s) {
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(
      kern::launch_int8_dequant(chunks, chunk_bytes, world, n, static_cast<ddp_dtype_t>(d), out, c.stream()));
}

void CudaDevice::reserve_flags(size_t slots) {
  if (slots <= nflags_) return;
  DeviceGuard g(device_);
  unsigned* fresh = nullptr;
  DDP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&fresh), slots * sizeof(unsigned)));
  try {
    zero_new(fresh, slots * sizeof(unsigned));
  } catch (...) {
    cudaFree(fresh);
    throw;
  }
  cudaFree(dev_flags_);
  dev_flags_ = fresh;
  nflags_ = slots;
}

// The kernel only ever sets its flag, so scans of one bucket accumulate; nothing waits here.
void CudaDevice::scan_nonfinite(const void* buf, size_t n, Dtype d, size_t slot, Stream& s) {
  if (n == 0) return;
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(kern::launch_nonfinite(buf, n, static_cast<ddp_dtype_t>(d), dev_flags_ + slot, c.stream()));
}

bool CudaDevice::take_nonfinite(size_t slot, Stream& s) {
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaMemcpyAsync(host_flag_, dev_flags_ + slot, sizeof(unsigned), cudaMemcpyDeviceToHost, c.stream()));
  DDP_CUDA_CHECK(cudaMemsetAsync(dev_flags_ + slot, 0, sizeof(unsigned), c.stream()));
  c.drain(Deadline::never());  // bounded by the deadlines of the collectives queued before
  return *host_flag_ != 0;
}

void CudaDevice::norm_terms(const void* buf, size_t n, Dtype d, Stream& s, double out[2]) {
  if (n == 0) return;
  CudaStream& c = cuda(s);
  DeviceGuard g(device_);
  if (!dev_partials_) {
    DDP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev_partials_), 2 * kern::kNormMaxBlocks * sizeof(double)));
    DDP_CUDA_CHECK(
        cudaMallocHost(reinterpret_cast<void**>(&host_partials_), 2 * kern::kNormMaxBlocks * sizeof(double)));
  }
  unsigned blocks = 0;
  DDP_CUDA_CHECK(kern::launch_norm(buf, n, static_cast<ddp_dtype_t>(d), dev_partials_, &blocks, c.stream()));
  DDP_CUDA_CHECK(
      cudaMemcpyAsync(host_partials_, dev_partials_, 2 * blocks * sizeof(double), cudaMemcpyDeviceToHost, c.stream()));
  c.drain(Deadline::never());  // bounded by the deadlines of the collectives queued before
  for (unsigned b = 0; b < blocks; ++b) {
    out[0] += host_partials_[2 * b];
    out[1] += host_partials_[2 * b + 1];
  }
}

void CudaDevice::reserve_marks(size_t slots) {
  DeviceGuard g(device_);
  while (marks_.size() < slots) {
    cudaEvent_t e = nullptr;
    DDP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    marks_.push_back(e);
  }
}

void CudaDevice::mark(size_t slot, Stream& s) {
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaEventRecord(marks_.at(slot), cuda(s).stream()));
}

void CudaDevice::user_wait_mark(void* user_stream, size_t slot) {
  DeviceGuard g(device_);
  DDP_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(user_stream), marks_.at(slot), 0));
}

}  // namespace ddp
