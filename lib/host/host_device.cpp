#include "host/host_device.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>

#include "host/host_kernels.hpp"
#include "core/knobs.hpp"
#include "kernels/kernel_bodies.h"

namespace ddp {

// What a stream's worker shares with the stream object: the worker holds its own reference, so that
// a worker written off while blocked in a collective outlives the stream that gave up on it.
struct WorkerState {
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  std::vector<Task*> ring = std::vector<Task*>(64, nullptr);
  size_t head = 0, tail = 0;
  uint64_t submitted = 0, finished = 0;
  bool stop = false, cancelled = false;
  bool running = false;    // a task is in run()
  int blocked = 0;         // ... and inside this many BlockingCalls (a hook's ddp_comm_allreduce nests)
  bool abandoned = false;  // written off: it parks when its call returns
  std::chrono::steady_clock::time_point task_start;
  int64_t task_timeout_ms = 0;
  int64_t stall_ms = 0;  // the stall warning (0: none)
  std::function<void()> stall_warn;
  uint64_t warned_task = UINT64_MAX;  // `finished` when the running task was warned about
  int64_t watch_ms = 0;               // the peer watch (0: none)
  std::function<void()> watch;
  std::chrono::steady_clock::time_point watched_at;  // its last call
  std::exception_ptr error;
  std::shared_ptr<std::atomic<bool>> device_abandoned;
};

namespace host {

namespace {
thread_local WorkerState* t_worker = nullptr;
std::atomic<bool> g_written_off{false};

[[noreturn]] void park_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}
}  // namespace

bool any_written_off() { return g_written_off.load(); }

BlockingCall::BlockingCall() : state_(t_worker) {
  if (!state_) return;
  std::lock_guard<std::mutex> lock(state_->mu);
  ++state_->blocked;
  state_->done_cv.notify_all();  // a drain waiting to write off a blocked worker may now do so
}

BlockingCall::~BlockingCall() {
  if (!state_) return;
  std::unique_lock<std::mutex> lock(state_->mu);
  --state_->blocked;
  if (!state_->abandoned) return;
  lock.unlock();
  park_forever();  // whatever called us may be freed by now
}

void keep_until_exit(std::shared_ptr<void> p) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::shared_ptr<void>>();  // reachable, never destroyed
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(std::move(p));
}

size_t piece_bytes() { return knobs::host_piece_bytes(); }

}  // namespace host

namespace {

void run_worker(std::shared_ptr<WorkerState> st);

// A stream backed by one worker thread and a fixed ring of task pointers.
class HostStream final : public Stream {
 public:
  HostStream(int index, std::shared_ptr<std::atomic<bool>> abandoned)
      : index_(index), st_(std::make_shared<WorkerState>()) {
    st_->device_abandoned = std::move(abandoned);
    worker_ = std::thread(run_worker, st_);
  }
  ~HostStream() override;

  void reserve(size_t n) override {
    std::lock_guard<std::mutex> lock(st_->mu);
    if (n + 1 > st_->ring.size() && st_->head == st_->tail) {
      st_->ring.assign(n + 1, nullptr);
      st_->head = st_->tail = 0;
    }
  }

  void submit(Task* task) override {
    {
      WorkerState& w = *st_;
      std::lock_guard<std::mutex> lock(w.mu);
      size_t next = (w.tail + 1) % w.ring.size();
      if (next == w.head) fail(DDP_ERR_INTERNAL, "host stream %d: task ring full", index_);
      w.ring[w.tail] = task;
      w.tail = next;
      ++w.submitted;
    }
    st_->work_cv.notify_one();
  }

  void drain(Deadline deadline) override { drain_to(UINT64_MAX, deadline); }
  uint64_t submitted() override {
    std::lock_guard<std::mutex> lock(st_->mu);
    return st_->submitted;
  }
  void drain_to(uint64_t mark, Deadline deadline) override;
  void run_blocking(const std::function<void()>& f) override {
    host::BlockingCall call;
    f();
  }

  void poll_error() override {
    std::lock_guard<std::mutex> lock(st_->mu);
    take_error();
  }

  bool runs_inline() const override { return false; }
  void set_task_timeout(int64_t ms) override {
    std::lock_guard<std::mutex> lock(st_->mu);
    st_->task_timeout_ms = ms;
  }
  void set_stall_warning(int64_t ms, std::function<void()> warn) override {
    std::lock_guard<std::mutex> lock(st_->mu);
    st_->stall_ms = ms;
    st_->stall_warn = std::move(warn);
  }
  void set_peer_watch(int64_t ms, std::function<void()> check) override {
    std::lock_guard<std::mutex> lock(st_->mu);
    st_->watch_ms = ms;
    st_->watch = std::move(check);
  }
  void* native() override { return nullptr; }
  void cancel() override {
    std::lock_guard<std::mutex> lock(st_->mu);
    st_->cancelled = true;
  }

 private:
  void take_error() {
    if (st_->error) {
      std::exception_ptr e = st_->error;
      st_->error = nullptr;
      std::rethrow_exception(e);
    }
  }
  // Writes the running task off (it is blocked in a collective): queued tasks are dropped, buffers
  // the device hands back from now on are kept, and the worker parks when its call returns.
  void abandon() {
    host::g_written_off.store(true);
    st_->abandoned = true;
    st_->cancelled = true;
    st_->device_abandoned->store(true);
  }

  int index_;
  std::shared_ptr<WorkerState> st_;
  std::thread worker_;
};

// The deadline is kept here, by the thread that waits, not by the worker that moves the bytes: the
// worker may sit in a blocking collective, which is much faster than polling one. A task that has
// been blocked in a collective for task_timeout_ms is written off; one that computes is waited for.
void HostStream::drain_to(uint64_t mark, Deadline deadline) {
  WorkerState& w = *st_;
  std::unique_lock<std::mutex> lock(w.mu);
  for (;;) {
    if (w.finished >= std::min(mark, w.submitted) || w.abandoned) break;
    if (w.cancelled && w.blocked) {  // after a fatal error nothing waits for a collective's peers
      abandon();
      break;
    }
    Deadline::Clock::time_point until = Deadline::Clock::time_point::max();
    if (!deadline.infinite()) until = deadline.at();
    const bool bounded = w.task_timeout_ms > 0 && w.running;
    if (bounded) until = std::min(until, add_ms_saturated(w.task_start, w.task_timeout_ms));
    const bool warn = w.stall_ms > 0 && w.running && w.warned_task != w.finished && w.stall_warn;
    const auto warn_at = add_ms_saturated(w.task_start, w.stall_ms);
    if (warn) until = std::min(until, warn_at);
    const bool watching = w.watch_ms > 0 && w.running && w.blocked && w.watch;
    const auto watch_at = add_ms_saturated(std::max(w.task_start, w.watched_at), w.watch_ms);
    if (watching) until = std::min(until, watch_at);
    if (until == Deadline::Clock::time_point::max()) {
      w.done_cv.wait(lock);
      continue;
    }
    if (w.done_cv.wait_until(lock, until) != std::cv_status::timeout) continue;
    if (watching && Deadline::Clock::now() >= watch_at && w.running && w.blocked) {
      w.watched_at = Deadline::Clock::now();
      std::function<void()> cb = w.watch;
      lock.unlock();
      cb();
      lock.lock();
      continue;
    }
    if (warn && Deadline::Clock::now() >= warn_at && w.running && w.warned_task != w.finished) {
      w.warned_task = w.finished;  // once per task
      std::function<void()> cb = w.stall_warn;
      lock.unlock();
      cb();
      lock.lock();
      continue;
    }
    if (deadline.passed()) fail(DDP_ERR_TIMEOUT, "stream %d: work still running at the deadline", index_);
    if (bounded && w.blocked) {
      abandon();
      fail(DDP_ERR_TIMEOUT,
           "a collective did not complete within timeout_ms (%lld ms): another rank stalled, "
           "died or issued a different collective",
           static_cast<long long>(w.task_timeout_ms));
    }
    if (bounded) w.done_cv.wait_for(lock, std::chrono::milliseconds(10));  // computing: give it time
  }
  take_error();
}

// A worker blocked for good in a collective is left behind (detached), never joined: nothing at
// destroy or exit waits for it.
HostStream::~HostStream() {
  WorkerState& w = *st_;
  {
    std::unique_lock<std::mutex> lock(w.mu);
    w.done_cv.wait(lock, [&] { return !w.running || w.blocked || w.abandoned; });
    if (w.running && !w.abandoned) abandon();
    w.stop = true;
  }
  w.work_cv.notify_all();
  if (w.abandoned)
    worker_.detach();
  else
    worker_.join();
}

void run_task(WorkerState& w, Task* task, std::unique_lock<std::mutex>& lock) {
  w.running = true;
  w.task_start = std::chrono::steady_clock::now();
  w.done_cv.notify_all();  // a drain that is waiting now has a task start to time its warning from
  lock.unlock();
  std::exception_ptr err;
  try {
    task->run();
  } catch (...) {
    err = std::current_exception();
  }
  lock.lock();
  w.running = false;
  if (err && !w.error) w.error = err;
  if (err) w.cancelled = true;  // later tasks of this stream depend on the failed one
}

void run_worker(std::shared_ptr<WorkerState> st) {
  name_this_thread("ddp-worker");
  WorkerState& w = *st;
  host::t_worker = &w;
  std::unique_lock<std::mutex> lock(w.mu);
  for (;;) {
    w.work_cv.wait(lock, [&] { return w.stop || w.head != w.tail; });
    if (w.head == w.tail || w.abandoned) return;  // stopping and nothing left, or written off
    Task* task = w.ring[w.head];
    w.head = (w.head + 1) % w.ring.size();
    if (!w.cancelled) run_task(w, task, lock);
    ++w.finished;
    w.done_cv.notify_all();
  }
}

}  // namespace

HostDevice::HostDevice() : abandoned_(std::make_shared<std::atomic<bool>>(false)) {}

void* HostDevice::alloc(size_t bytes) {
  if (bytes == 0) bytes = 1;
  void* p = nullptr;
  // 256-byte alignment: what arena buckets are aligned to, and what vector loads like.
  size_t rounded = (bytes + 255) / 256 * 256;
  if (posix_memalign(&p, 256, rounded) != 0 || p == nullptr)
    fail(DDP_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes of host memory", bytes);
  std::memset(p, 0, rounded);
  return p;
}

void HostDevice::free(void* p) { std::free(p); }

void HostDevice::release(void* p) {
  if (!p) return;
  if (abandoned_->load())
    host::keep_until_exit(std::shared_ptr<void>(p, [](void* q) { std::free(q); }));
  else
    std::free(p);
}

void HostDevice::copy(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memmove(dst, src, bytes);
}

std::unique_ptr<Stream> HostDevice::make_stream(int index) {
  return std::unique_ptr<Stream>(new HostStream(index, abandoned_));
}

// Calls fn(segment, first, count) for the part of each segment inside `span` (segments are sorted by
// offset, the first one found by binary search: a bucket is packed piece by piece).
template <class F>
static void for_span(SegmentTable& table, Span span, F&& fn) {
  std::vector<Segment>& segs = table.segs;
  auto it = std::upper_bound(segs.begin(), segs.end(), span.lo,
                             [](size_t lo, const Segment& seg) { return lo < seg.offset; });
  if (it != segs.begin()) --it;
  for (; it != segs.end() && it->offset < span.hi; ++it) {
    const size_t a = std::max(span.lo, it->offset), b = std::min(span.hi, it->offset + it->numel);
    if (a < b) fn(*it, a - it->offset, b - a);
  }
}

// pack and unpack with the packed element `origin` at the start of the packed buffer.
static void pack_from(SegmentTable& table, Dtype src, char* out, Dtype wire, double scale, Span span, size_t origin) {
  const size_t ws = dtype_size(wire), ss = dtype_size(src);
  for_span(table, span, [&](const Segment& seg, size_t first, size_t n) {
    void* to = out + (seg.offset + first - origin) * ws;
    if (seg.zero)
      std::memset(to, 0, n * ws);
    else
      host::convert(static_cast<const char*>(seg.ptr) + first * ss, src, to, wire, n, scale);
  });
}

static void unpack_from(const char* in, Dtype wire, SegmentTable& table, Dtype dst, double scale, Span span,
                        size_t origin) {
  const size_t ws = dtype_size(wire), ds = dtype_size(dst);
  for_span(table, span, [&](const Segment& seg, size_t first, size_t n) {
    host::convert(in + (seg.offset + first - origin) * ws, wire, static_cast<char*>(seg.ptr) + first * ds, dst, n,
                  scale);
  });
}

void HostDevice::pack(SegmentTable& table, Dtype src, void* dst, Dtype wire, double scale, Span span, Stream&) {
  pack_from(table, src, static_cast<char*>(dst), wire, scale, span, 0);
}

void HostDevice::unpack(const void* src, Dtype wire, SegmentTable& table, Dtype dst, double scale, Span span, Stream&) {
  unpack_from(static_cast<const char*>(src), wire, table, dst, scale, span, 0);
}

// 16 int8 blocks: 16 KiB of f32 (32 of f64), in L1 with the chunk bytes they become.
constexpr size_t kInt8Tile = 16 * elem::kInt8Block;

// Where the elements `tile` lie in one grad, unscaled, so that the int8 loops can read or write them
// there (most tiles: grads are larger); nullptr when they need the tile buffer. `reading`: a zero
// segment holds no values to read (unpack writes it like any other).
static char* in_one_grad(SegmentTable& table, Span tile, Dtype d, double scale, bool reading) {
  char* at = nullptr;
  if (scale == 1.0)
    for_span(table, tile, [&](const Segment& seg, size_t first, size_t k) {
      if (k == tile.hi - tile.lo && !(reading && seg.zero)) at = static_cast<char*>(seg.ptr) + first * dtype_size(d);
    });
  return at;
}

void HostDevice::int8_quantize_grads(SegmentTable& table, Dtype d, double pre, Span span, float* residual, void* chunk,
                                     Stream&) {
  alignas(64) char tile[kInt8Tile * sizeof(double)];
  const size_t n = span.hi - span.lo;
  for (size_t at = 0; at < n; at += kInt8Tile) {
    const size_t len = std::min(kInt8Tile, n - at);
    const Span t{span.lo + at, span.lo + at + len};
    const char* from = in_one_grad(table, t, d, pre, true);
    if (!from) pack_from(table, d, tile, d, pre, t, t.lo);
    host::int8_quantize_span(from ? from : tile, d, n, at, len, residual + at, chunk);
  }
}

void HostDevice::int8_dequant_grads(const void* chunks, size_t chunk_bytes, int world, Span span, SegmentTable& table,
                                    Dtype d, double post, Stream&) {
  alignas(64) char tile[kInt8Tile * sizeof(double)];
  const size_t n = span.hi - span.lo;
  for (size_t at = 0; at < n; at += kInt8Tile) {
    const size_t len = std::min(kInt8Tile, n - at);
    const Span t{span.lo + at, span.lo + at + len};
    char* into = in_one_grad(table, t, d, post, false);
    host::int8_dequant_sum_span(chunks, chunk_bytes, world, n, at, len, d, into ? into : tile);
    if (!into) unpack_from(tile, d, table, d, post, t, t.lo);
  }
}

void HostDevice::scale(void* buf, size_t n, Dtype d, double scale, Stream&) {
  if (scale != 1.0) host::convert(buf, d, buf, d, n, scale);
}

void HostDevice::fill_zero(void* buf, size_t n, Dtype d, Stream&) { std::memset(buf, 0, n * dtype_size(d)); }

void HostDevice::reserve_flags(size_t slots) {
  if (slots <= nflags_) return;
  flags_.reset(new std::atomic<bool>[slots]);
  for (size_t i = 0; i < slots; ++i) flags_[i] = false;
  nflags_ = slots;
}

// The worker sets the flag; the host reads it after drain, which orders the two.
void HostDevice::scan_nonfinite(const void* buf, size_t n, Dtype d, size_t slot, Stream&) {
  if (host::has_nonfinite(buf, n, d)) flags_[slot].store(true, std::memory_order_relaxed);
}

bool HostDevice::take_nonfinite(size_t slot, Stream&) {
  return flags_[slot].exchange(false, std::memory_order_relaxed);
}

// The kernel's body as one thread over the whole buffer.
void HostDevice::norm_terms(const void* buf, size_t n, Dtype d, Stream&, double out[2]) {
  double sq = 0.0, bad = 0.0;
  kern::with_dtype(static_cast<ddp_dtype_t>(d), [&](auto t) {
    typedef decltype(t) T;
    kern::norm_thread<T>(static_cast<const typename T::storage*>(buf), n, 0, 0, 1, 1, &sq, &bad);
  });
  out[0] += sq;
  out[1] += bad;
}

}  // namespace ddp
