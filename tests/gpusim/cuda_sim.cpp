// The simulated CUDA runtime (tests only): device memory is host memory the simulation tracks, and
// each stream is a queue run in order by its own thread, with a random delay before each operation,
// so that a missing stream wait or a host read before a synchronization gives wrong values (and a
// data race under TSan) instead of passing by luck. What it models and what it does not:
// tests/gpusim/README.md.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "gpusim.h"

namespace {

using Clock = std::chrono::steady_clock;

// The completion of one enqueued operation. Waits for a stream or an event wait on these.
struct Marker {
  bool done = false;
  Clock::time_point at;
};
using MarkerP = std::shared_ptr<Marker>;

std::mutex g_done_mu;  // guards every Marker::done
std::condition_variable g_done_cv;

void complete(const MarkerP& m) {
  std::lock_guard<std::mutex> lock(g_done_mu);
  m->done = true;
  m->at = Clock::now();
  g_done_cv.notify_all();
}

void wait_for(const MarkerP& m) {
  if (!m) return;
  std::unique_lock<std::mutex> lock(g_done_mu);
  g_done_cv.wait(lock, [&] { return m->done; });
}

bool is_done(const MarkerP& m) {
  if (!m) return true;
  std::lock_guard<std::mutex> lock(g_done_mu);
  return m->done;
}

long env_long(const char* name, long fallback) {
  const char* v = getenv(name);
  return v && *v ? atol(v) : fallback;
}

}  // namespace

struct CUstream_st {
  int device = 0;
  bool nonblocking = false;
  bool legacy = false;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<std::function<void()>, MarkerP>> queue;
  MarkerP tail;  // the last operation enqueued (null: none yet)
  bool stop = false;
  std::thread worker;
  std::mt19937_64 rng;
};

struct CUevent_st {
  unsigned flags = 0;
  MarkerP last;  // the completion of the latest record (null: never recorded)
};

namespace {

struct Allocation {
  size_t bytes;
  int device;  // -1: pinned host memory
};

struct Registry {
  std::mutex mu;
  int devices = 0;
  size_t memory_limit = 0;
  std::vector<size_t> used;
  std::map<const char*, Allocation> allocations;
  std::set<cudaStream_t> streams;    // live created streams
  std::vector<cudaStream_t> legacy;  // per device
  std::set<cudaEvent_t> events;
  std::vector<cudaError_t> sticky;  // per device: a fault breaks the context for good
  long delay_us = 0;
  uint64_t seed = 0;
};

Registry& reg();
std::atomic<long> g_delay_us{0};
std::atomic<uint64_t> g_seed{0};

thread_local cudaError_t t_last_error = cudaSuccess;
thread_local int t_device = 0;
// Whether a context is current on this thread. A thread starts with none; cudaSetDevice and the
// first call that needs one (an allocation, a stream, a copy) make the current device's primary
// context current, as the runtime does; cuCtxSetCurrent(NULL) leaves none again.
thread_local bool t_context = false;
std::set<cudaStream_t> g_capturing;  // under reg().mu: streams tests declared as being captured

cudaError_t note(cudaError_t rc) {
  if (rc != cudaSuccess) t_last_error = rc;
  return rc;
}

// The stream's thread: runs each operation in order after a random delay.
void run_stream(cudaStream_t s) {
  for (;;) {
    std::pair<std::function<void()>, MarkerP> op;
    {
      std::unique_lock<std::mutex> lock(s->mu);
      s->cv.wait(lock, [&] { return s->stop || !s->queue.empty(); });
      if (s->queue.empty()) return;
      op = std::move(s->queue.front());
      s->queue.pop_front();
    }
    const long max_us = g_delay_us.load();
    if (max_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(s->rng() % (max_us + 1)));
    op.first();
    complete(op.second);
  }
}

cudaStream_t make_stream(int device, bool nonblocking, bool legacy) {
  cudaStream_t s = new CUstream_st();
  s->device = device;
  s->nonblocking = nonblocking;
  s->legacy = legacy;
  static std::atomic<uint64_t> made{0};
  s->rng.seed(g_seed.load() + 7919 * made.fetch_add(1));
  s->worker = std::thread(run_stream, s);
  return s;
}

Registry& reg() {
  static Registry* r = [] {
    Registry* x = new Registry();  // never destroyed: stream threads may outlive static destructors
    const char* vis = getenv("CUDA_VISIBLE_DEVICES");
    x->devices = vis && !*vis ? 0 : static_cast<int>(env_long("DDP_GPUSIM_DEVICES", 2));
    x->memory_limit = static_cast<size_t>(env_long("DDP_GPUSIM_MEMORY_MB", 8192)) << 20;
    x->used.assign(static_cast<size_t>(x->devices), 0);
    x->sticky.assign(static_cast<size_t>(x->devices), cudaSuccess);
    x->delay_us = env_long("DDP_GPUSIM_DELAY_US", 100);
    x->seed = static_cast<uint64_t>(env_long("DDP_GPUSIM_SEED", static_cast<long>(time(nullptr) ^ getpid())));
    g_delay_us = x->delay_us;
    g_seed = x->seed;
    return x;
  }();
  static std::once_flag once;
  std::call_once(once, [] {
    for (int d = 0; d < r->devices; ++d) r->legacy.push_back(make_stream(d, false, true));
  });
  return *r;
}

// The stream a handle names (null and cudaStreamLegacy: the current device's legacy stream; the
// per-thread default stream is treated as the legacy one), or null if it names none.
cudaStream_t resolve(cudaStream_t s) {
  Registry& r = reg();
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) {
    if (t_device < 0 || t_device >= r.devices) return nullptr;
    t_context = true;
    return r.legacy[static_cast<size_t>(t_device)];
  }
  std::lock_guard<std::mutex> lock(r.mu);
  return r.streams.count(s) ? s : nullptr;
}

cudaError_t sticky(int device) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  return device >= 0 && device < r.devices ? r.sticky[static_cast<size_t>(device)] : cudaSuccess;
}

// The legacy stream's rule: work on it waits for all earlier work of the device's blocking streams,
// and work on a blocking stream waits for earlier work on the legacy stream. Non-blocking streams do
// neither.
std::vector<MarkerP> implicit_waits(cudaStream_t s) {
  Registry& r = reg();
  std::vector<MarkerP> w;
  if (s->nonblocking) return w;
  std::vector<cudaStream_t> others;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (s->legacy) {
      for (cudaStream_t o : r.streams)
        if (o->device == s->device && !o->nonblocking) others.push_back(o);
    } else {
      others.push_back(r.legacy[static_cast<size_t>(s->device)]);
    }
  }
  for (cudaStream_t o : others) {
    std::lock_guard<std::mutex> lock(o->mu);
    if (o->tail) w.push_back(o->tail);
  }
  return w;
}

MarkerP push(cudaStream_t s, std::function<void()> op) {
  std::vector<MarkerP> waits = implicit_waits(s);
  MarkerP m = std::make_shared<Marker>();
  std::function<void()> full = waits.empty() ? std::move(op) : [waits, op]() {
    for (const MarkerP& w : waits) wait_for(w);
    op();
  };
  std::lock_guard<std::mutex> lock(s->mu);
  s->queue.emplace_back(std::move(full), m);
  s->tail = m;
  s->cv.notify_one();
  return m;
}

MarkerP tail_of(cudaStream_t s) {
  std::lock_guard<std::mutex> lock(s->mu);
  return s->tail;
}

// Every stream of `device` (created and legacy), for device-wide synchronization.
std::vector<cudaStream_t> streams_of(int device) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<cudaStream_t> v;
  for (cudaStream_t s : r.streams)
    if (s->device == device) v.push_back(s);
  if (device >= 0 && device < r.devices) v.push_back(r.legacy[static_cast<size_t>(device)]);
  return v;
}

void sync_device(int device) {
  std::vector<MarkerP> tails;
  for (cudaStream_t s : streams_of(device)) tails.push_back(tail_of(s));
  for (const MarkerP& m : tails) wait_for(m);
}

// The allocation holding [p, p + bytes), or null.
const Allocation* find(const void* p, size_t bytes, const char** base = nullptr) {
  Registry& r = reg();
  const char* c = static_cast<const char*>(p);
  auto it = r.allocations.upper_bound(c);
  if (it == r.allocations.begin()) return nullptr;
  --it;
  if (c < it->first || c + bytes > it->first + it->second.bytes || (bytes == 0 && c >= it->first + it->second.bytes))
    return nullptr;
  if (base) *base = it->first;
  return &it->second;
}

// What memory `p` is: a device number, -1 pinned host, -2 anything else (pageable).
int kind_of(const void* p, size_t bytes) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  const Allocation* a = find(p, bytes);
  return a ? a->device : -2;
}

bool check_device() {
  Registry& r = reg();
  const bool ok = t_device >= 0 && t_device < r.devices;
  if (ok) t_context = true;
  return ok;
}

// Checks a copy's kind against where its pointers lie, as the real runtime does with unified
// addressing (cudaMemcpyDefault infers it).
cudaError_t check_copy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  if (n == 0) return cudaSuccess;
  if (!dst || !src) return cudaErrorInvalidValue;
  const int dk = kind_of(dst, n), sk = kind_of(src, n);
  const bool dd = dk >= 0, sd = sk >= 0;
  switch (kind) {
    case cudaMemcpyHostToHost: return dd || sd ? cudaErrorInvalidValue : cudaSuccess;
    case cudaMemcpyHostToDevice: return dd && !sd ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToHost: return !dd && sd ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToDevice: return dd && sd ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDefault: return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

// An asynchronous copy with the runtime's documented host-side behaviour: from pageable host memory
// the bytes are staged before the call returns; to pageable host memory the call returns once the
// copy is done; pinned memory and device memory are read and written when the stream gets there.
cudaError_t copy_async(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t stream) {
  cudaStream_t s = resolve(stream);
  if (!s) return cudaErrorInvalidResourceHandle;
  if (cudaError_t e = sticky(s->device)) return e;
  if (cudaError_t e = check_copy(dst, src, n, kind)) return e;
  if (n == 0) return cudaSuccess;
  const bool src_pageable = kind_of(src, n) == -2, dst_pageable = kind_of(dst, n) == -2;
  if (src_pageable) {
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + n);
    push(s, [dst, staged, n] { memcpy(dst, staged->data(), n); });
  } else {
    MarkerP m = push(s, [dst, src, n] { memmove(dst, src, n); });
    if (dst_pageable) wait_for(m);
  }
  return cudaSuccess;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// What the other simulated pieces use
// ---------------------------------------------------------------------------------------------

namespace gpusim {

cudaError_t enqueue(cudaStream_t stream, std::function<void()> op) {
  cudaStream_t s = resolve(stream);
  if (!s) return cudaErrorInvalidResourceHandle;
  if (cudaError_t e = sticky(s->device)) return e;
  push(s, std::move(op));
  return cudaSuccess;
}

int stream_device(cudaStream_t stream) {
  cudaStream_t s = resolve(stream);
  return s ? s->device : -1;
}

bool device_range(const void* p, size_t bytes, int* device) {
  const int k = kind_of(p, bytes);
  if (device) *device = k;
  return k >= 0;
}

void fault(int device, const char* what) {
  fprintf(stderr, "gpusim: device %d: illegal address: %s\n", device, what);
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  if (device >= 0 && device < r.devices) r.sticky[static_cast<size_t>(device)] = cudaErrorIllegalAddress;
}

int current_device() { return t_device; }

bool thread_has_context() { return t_context; }

void set_capturing(cudaStream_t stream, bool capturing) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  if (capturing)
    g_capturing.insert(stream);
  else
    g_capturing.erase(stream);
}

}  // namespace gpusim

// ---------------------------------------------------------------------------------------------
// The runtime API
// ---------------------------------------------------------------------------------------------

extern "C" {

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorUnknown: return "cudaErrorUnknown";
  }
  return "unrecognized error code";
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorUnknown: return "unknown error";
  }
  return "unrecognized error code";
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  if (cudaError_t s = sticky(t_device)) return s;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  if (cudaError_t s = sticky(t_device)) return s;
  return t_last_error;
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return note(cudaErrorInvalidValue);
  *count = reg().devices;
  return note(reg().devices ? cudaSuccess : cudaErrorNoDevice);
}

cudaError_t cudaGetDevice(int* device) {
  if (!device) return note(cudaErrorInvalidValue);
  if (reg().devices == 0) return note(cudaErrorNoDevice);
  *device = t_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (reg().devices == 0) return note(cudaErrorNoDevice);
  if (device < 0 || device >= reg().devices) return note(cudaErrorInvalidDevice);
  t_device = device;
  t_context = true;  // CUDA 12: cudaSetDevice initializes the device's primary context and makes it current
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (!prop) return note(cudaErrorInvalidValue);
  if (device < 0 || device >= reg().devices) return note(cudaErrorInvalidDevice);
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "libddp simulated GPU %d", device);
  prop->totalGlobalMem = reg().memory_limit;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->warpSize = 32;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  if (!check_device()) return note(cudaErrorNoDevice);
  sync_device(t_device);
  return note(sticky(t_device));
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (!ptr) return note(cudaErrorInvalidValue);
  if (!check_device()) return note(cudaErrorNoDevice);
  if (cudaError_t e = sticky(t_device)) return note(e);
  *ptr = nullptr;
  if (bytes == 0) return cudaSuccess;
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  size_t& used = r.used[static_cast<size_t>(t_device)];
  if (used + bytes > r.memory_limit) return note(cudaErrorMemoryAllocation);
  void* p = aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (!p) return note(cudaErrorMemoryAllocation);
  memset(p, 0xcd, bytes);  // fresh device memory holds garbage, never zeros by luck
  used += bytes;
  r.allocations[static_cast<const char*>(p)] = Allocation{bytes, t_device};
  *ptr = p;
  return cudaSuccess;
}

// cudaFree synchronizes the device first (the runtime documents an implicit synchronization), then
// fills the memory with a pattern, so that a late reader sees garbage.
cudaError_t cudaFree(void* ptr) {
  if (!ptr) return cudaSuccess;
  int device = -1;
  {
    Registry& r = reg();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.allocations.find(static_cast<const char*>(ptr));
    if (it == r.allocations.end() || it->second.device < 0) return note(cudaErrorInvalidValue);
    device = it->second.device;
  }
  sync_device(device);
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.allocations.find(static_cast<const char*>(ptr));
  if (it == r.allocations.end()) return note(cudaErrorInvalidValue);
  memset(ptr, 0xdd, it->second.bytes);
  r.used[static_cast<size_t>(device)] -= it->second.bytes;
  r.allocations.erase(it);
  free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
  if (!ptr) return note(cudaErrorInvalidValue);
  void* p = aligned_alloc(256, (bytes ? bytes + 255 : 256) / 256 * 256);
  if (!p) return note(cudaErrorMemoryAllocation);
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  r.allocations[static_cast<const char*>(p)] = Allocation{bytes ? bytes : 1, -1};
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (!ptr) return cudaSuccess;
  for (int d = 0; d < reg().devices; ++d) sync_device(d);
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.allocations.find(static_cast<const char*>(ptr));
  if (it == r.allocations.end() || it->second.device != -1) return note(cudaErrorInvalidValue);
  r.allocations.erase(it);
  free(ptr);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* ptr) {
  if (!a) return note(cudaErrorInvalidValue);
  memset(a, 0, sizeof *a);
  a->device = -2;
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  const char* base = nullptr;
  const Allocation* al = find(ptr, 1, &base);
  if (!al) {
    a->type = cudaMemoryTypeUnregistered;
    return cudaSuccess;
  }
  if (al->device >= 0) {
    a->type = cudaMemoryTypeDevice;
    a->device = al->device;
    a->devicePointer = const_cast<void*>(ptr);
  } else {
    a->type = cudaMemoryTypeHost;
    a->device = t_device;
    a->devicePointer = const_cast<void*>(ptr);
    a->hostPointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t stream) {
  return note(copy_async(dst, src, n, kind, stream));
}

// The "synchronous" copies and sets run on the legacy stream. As documented for the runtime, a copy
// between two device buffers and a memset of device memory return before the work is done (they are
// ordered only by the legacy stream: after earlier work of blocking streams, not with non-blocking
// ones); a copy that involves host memory returns when it is done.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  if (!check_device()) return note(cudaErrorNoDevice);
  cudaError_t e = copy_async(dst, src, n, kind, nullptr);
  if (e) return note(e);
  if (kind_of(dst, n) >= 0 && kind_of(src, n) >= 0) return cudaSuccess;
  wait_for(tail_of(resolve(nullptr)));
  return note(sticky(t_device));
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t n, cudaStream_t stream) {
  cudaStream_t s = resolve(stream);
  if (!s) return note(cudaErrorInvalidResourceHandle);
  if (cudaError_t e = sticky(s->device)) return note(e);
  if (n == 0) return cudaSuccess;
  if (kind_of(ptr, n) < 0) return note(cudaErrorInvalidValue);
  push(s, [ptr, value, n] { memset(ptr, value, n); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void* ptr, int value, size_t n) {
  if (!check_device()) return note(cudaErrorNoDevice);
  return cudaMemsetAsync(ptr, value, n, nullptr);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (!stream) return note(cudaErrorInvalidValue);
  if (!check_device()) return note(cudaErrorNoDevice);
  cudaStream_t s = make_stream(t_device, (flags & cudaStreamNonBlocking) != 0, false);
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  r.streams.insert(s);
  *stream = s;
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }

// The runtime returns at once and releases the stream when its work is done; here the stream's
// thread finishes the queue and the stream is freed then, while the handle is invalid at once.
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Registry& r = reg();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (!stream || !r.streams.erase(stream)) return note(cudaErrorInvalidResourceHandle);
  }
  {
    std::lock_guard<std::mutex> lock(stream->mu);
    stream->stop = true;
    stream->cv.notify_one();
  }
  std::thread([stream] {
    stream->worker.join();
    delete stream;
  }).detach();
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  cudaStream_t s = resolve(stream);
  if (!s) return note(cudaErrorInvalidResourceHandle);
  wait_for(tail_of(s));
  return note(sticky(s->device));
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  cudaStream_t s = resolve(stream);
  if (!s) return note(cudaErrorInvalidResourceHandle);
  if (cudaError_t e = sticky(s->device)) return note(e);
  return is_done(tail_of(s)) ? cudaSuccess : cudaErrorNotReady;
}

// The wait captures the event's latest record at the time of the call, as the runtime does.
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  cudaStream_t s = resolve(stream);
  if (!s) return note(cudaErrorInvalidResourceHandle);
  Registry& r = reg();
  MarkerP m;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.events.count(event)) return note(cudaErrorInvalidResourceHandle);
    m = event->last;
  }
  if (m) push(s, [m] { wait_for(m); });
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  if (!status) return note(cudaErrorInvalidValue);
  if (!resolve(stream)) return note(cudaErrorInvalidResourceHandle);
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  *status = g_capturing.count(stream) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

// The driver's current context: a token per device (null: none current).
static char g_contexts[64];

static int sim_ctx_get_current(void** ctx) {
  *ctx = t_context ? &g_contexts[t_device] : nullptr;
  return 0;
}

static int sim_ctx_set_current(void* ctx) {
  if (!ctx) {
    t_context = false;
    t_device = 0;  // what the runtime answers on a thread without a context
    return 0;
  }
  t_device = static_cast<int>(static_cast<char*>(ctx) - g_contexts);
  t_context = true;
  return 0;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int, unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  if (!symbol || !fn) return note(cudaErrorInvalidValue);
  *fn = nullptr;
  if (strcmp(symbol, "cuCtxGetCurrent") == 0) *fn = reinterpret_cast<void*>(&sim_ctx_get_current);
  if (strcmp(symbol, "cuCtxSetCurrent") == 0) *fn = reinterpret_cast<void*>(&sim_ctx_set_current);
  if (status) *status = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (!event) return note(cudaErrorInvalidValue);
  cudaEvent_t e = new CUevent_st();
  e->flags = flags;
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.insert(e);
  *event = e;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.events.erase(event)) return note(cudaErrorInvalidResourceHandle);
  delete event;  // waits already enqueued hold their own reference to the marker
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  cudaStream_t s = resolve(stream);
  if (!s) return note(cudaErrorInvalidResourceHandle);
  MarkerP m = push(s, [] {});
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.events.count(event)) return note(cudaErrorInvalidResourceHandle);
  event->last = m;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  MarkerP m;
  {
    Registry& r = reg();
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.events.count(event)) return note(cudaErrorInvalidResourceHandle);
    m = event->last;
  }
  wait_for(m);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  MarkerP m;
  {
    Registry& r = reg();
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.events.count(event)) return note(cudaErrorInvalidResourceHandle);
    m = event->last;
  }
  return is_done(m) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!ms) return note(cudaErrorInvalidValue);
  MarkerP a, b;
  {
    Registry& r = reg();
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.events.count(start) || !r.events.count(end)) return note(cudaErrorInvalidResourceHandle);
    if ((start->flags | end->flags) & cudaEventDisableTiming) return note(cudaErrorInvalidResourceHandle);
    a = start->last;
    b = end->last;
  }
  if (!a || !b) return note(cudaErrorInvalidResourceHandle);
  if (!is_done(a) || !is_done(b)) return cudaErrorNotReady;
  std::lock_guard<std::mutex> lock(g_done_mu);
  *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
  return cudaSuccess;
}

}  // extern "C"
