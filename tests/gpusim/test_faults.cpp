// Faults only the simulation can make (part of the gpusim build of the GPU tests): a collective that
// never completes (a peer that never arrives) and one that fails asynchronously. Both must surface
// at ddp_finish_backward with the right status and message, abort the context, and let ddp_destroy
// return; the stuck collective must be released by ncclCommAbort.
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test.hpp"
#include "gpusim.h"

namespace {

struct Rig {
  ddp_comm_t comm = nullptr;
  ddp_t ddp = nullptr;
  void* grad = nullptr;
  int index = -1;
  explicit Rig(int64_t timeout_ms) {
    ddp_nccl_id_t id;
    DDP_OK(ddp_nccl_get_unique_id(&id));
    DDP_OK(ddp_comm_init_nccl(&id, 1, 0, 0, &comm));
    ddp_config_t cfg;
    DDP_OK(ddp_config_init(&cfg));
    cfg.plan_order = DDP_PLAN_REGISTRATION;
    cfg.timeout_ms = timeout_ms;
    DDP_OK(ddp_create(comm, &cfg, &ddp));
    CUDA_OK(cudaMalloc(&grad, 4096 * sizeof(float)));
    CUDA_OK(cudaMemset(grad, 0, 4096 * sizeof(float)));
    DDP_OK(ddp_register_grad(ddp, grad, 4096, DDP_F32, 0, &index));
    DDP_OK(ddp_begin_backward(ddp, nullptr));  // one clean iteration first
    DDP_OK(ddp_grad_ready(ddp, index));
    DDP_OK(ddp_finish_backward(ddp, nullptr));
    // Finished before a test injects a fault: ddp_finish_backward only enqueued the collective.
    DDP_OK(ddp_synchronize(ddp));
  }
  ~Rig() {
    ddp_destroy(ddp);
    ddp_comm_destroy(comm);
    cudaFree(grad);
  }
};

bool has(const char* text, const char* needle) { return std::string(text).find(needle) != std::string::npos; }

// Turns the injected faults off when a test ends, a failed REQUIRE included: a fault left on would
// fail every later case.
struct NoFaultsAfter {
  ~NoFaultsAfter() {
    gpusim::nccl_stall_collectives(false);
    gpusim::nccl_fail_collectives(ncclSuccess);
  }
};

}  // namespace

GPU_TEST_CASE("gpusim faults: a collective that never completes times out, aborts, and destroy returns") {
  Rig rig(400);
  NoFaultsAfter faults_off;
  gpusim::nccl_stall_collectives(true);
  DDP_OK(ddp_begin_backward(rig.ddp, nullptr));
  DDP_OK(ddp_grad_ready(rig.ddp, rig.index));
  const auto t0 = std::chrono::steady_clock::now();
  ddp_status_t st = ddp_finish_backward(rig.ddp, nullptr);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  gpusim::nccl_stall_collectives(false);
  CHECK(st == DDP_ERR_TIMEOUT);
  CHECK(has(ddp_last_error(), "did not complete before the timeout"));
  CHECK(ms < 400 + 1000);
  CHECK(ddp_begin_backward(rig.ddp, nullptr) == DDP_ERR_ABORTED);
  const auto t1 = std::chrono::steady_clock::now();
  CHECK(ddp_destroy(rig.ddp) == DDP_SUCCESS);
  rig.ddp = nullptr;
  CHECK(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count() < 1000);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);  // the stuck collective was released by the abort
}

GPU_TEST_CASE("gpusim faults: an asynchronous NCCL error surfaces at the next check and aborts the context") {
  Rig rig(60000);
  NoFaultsAfter faults_off;
  gpusim::nccl_fail_collectives(ncclRemoteError);
  DDP_OK(ddp_begin_backward(rig.ddp, nullptr));
  // Nothing waits on the host for GPU streams: the error surfaces at the first poll after the
  // collective failed. That may be the poll of ddp_grad_ready's own enqueue (the communicators are
  // nonblocking), ddp_finish_backward's, or ddp_synchronize, which waits.
  ddp_status_t st = ddp_grad_ready(rig.ddp, rig.index);
  if (st == DDP_SUCCESS) st = ddp_finish_backward(rig.ddp, nullptr);
  if (st == DDP_SUCCESS) st = ddp_synchronize(rig.ddp);
  gpusim::nccl_fail_collectives(ncclSuccess);
  CHECK(st == DDP_ERR_NCCL);
  CHECK(has(ddp_last_error(), "asynchronous error"));
  CHECK(has(ddp_last_error(), "remote process exited"));
  CHECK(ddp_begin_backward(rig.ddp, nullptr) == DDP_ERR_ABORTED);
  CHECK(ddp_destroy(rig.ddp) == DDP_SUCCESS);
  rig.ddp = nullptr;
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
}

// ---------------------------------------------------------------------------------------------
// Ordering, watchdog, guest behaviour and graph capture: each case below fails on the backend
// without the change it is named after (tests/gpusim/README.md).
// ---------------------------------------------------------------------------------------------

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// A context over a fresh one-rank communicator on `device`, with `n` grads of 1024 floats, one
// bucket each, registration order (bucket 0 holds the last grad registered: backward order, so
// index[n - 1] is the first to mark ready); copy layout: the test's own buffers.
struct Ctx {
  ddp_comm_t comm = nullptr;
  ddp_t ddp = nullptr;
  std::vector<void*> grads;
  std::vector<int> index;
  Ctx(int n, int streams, int layout, int64_t timeout_ms, int device = 0) {
    ddp_nccl_id_t id;
    DDP_OK(ddp_nccl_get_unique_id(&id));
    DDP_OK(ddp_comm_init_nccl(&id, 1, 0, device, &comm));
    ddp_config_t cfg;
    DDP_OK(ddp_config_init(&cfg));
    cfg.plan_order = DDP_PLAN_REGISTRATION;
    cfg.message_size = 1024;
    cfg.num_streams = streams;
    cfg.layout = layout;
    cfg.timeout_ms = timeout_ms;
    cfg.unused_policy = DDP_UNUSED_ZERO;  // no exchange of its own at ddp_finish_backward
    DDP_OK(ddp_create(comm, &cfg, &ddp));
    for (int i = 0; i < n; ++i) {
      void* g = nullptr;
      if (layout == DDP_LAYOUT_COPY) {
        CUDA_OK(cudaSetDevice(device));
        CUDA_OK(cudaMalloc(&g, 1024 * sizeof(float)));
        // Zeroed on a stream of its own: the legacy stream may be held up by a test's busy stream.
        cudaStream_t z = nullptr;
        CUDA_OK(cudaStreamCreateWithFlags(&z, cudaStreamNonBlocking));
        CUDA_OK(cudaMemsetAsync(g, 0, 1024 * sizeof(float), z));
        CUDA_OK(cudaStreamSynchronize(z));
        CUDA_OK(cudaStreamDestroy(z));
      }
      int k = -1;
      DDP_OK(ddp_register_grad(ddp, g, 1024, DDP_F32, 0, &k));
      grads.push_back(g);
      index.push_back(k);
    }
    // One clean iteration first: the control path's exchanges (agreement, the unused-grad report)
    // are over before a test stalls collectives.
    // On a non-blocking stream: the legacy one may be held up by a test's busy stream.
    cudaStream_t us = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&us, cudaStreamNonBlocking));
    DDP_OK(ddp_begin_backward(ddp, us));
    for (int k : index) DDP_OK(ddp_grad_ready(ddp, k));
    DDP_OK(ddp_finish_backward(ddp, us));
    DDP_OK(ddp_synchronize(ddp));
    CUDA_OK(cudaStreamSynchronize(us));
    CUDA_OK(cudaStreamDestroy(us));
  }
  ~Ctx() {
    if (ddp) ddp_destroy(ddp);
    ddp_comm_destroy(comm);
    for (void* g : grads) cudaFree(g);
  }
};

}  // namespace

GPU_TEST_CASE("gpusim ordering: the arena is zeroed before ddp_grad_ptr hands it out, not later on the legacy stream") {
  ddp_nccl_id_t id;
  DDP_OK(ddp_nccl_get_unique_id(&id));
  ddp_comm_t comm = nullptr;
  DDP_OK(ddp_comm_init_nccl(&id, 1, 0, 0, &comm));
  ddp_config_t cfg;
  DDP_OK(ddp_config_init(&cfg));
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.layout = DDP_LAYOUT_ARENA;
  cfg.unused_policy = DDP_UNUSED_ZERO;
  ddp_t ddp = nullptr;
  DDP_OK(ddp_create(comm, &cfg, &ddp));
  CUDA_OK(cudaSetDevice(0));
  // The legacy stream is busy (earlier work of the caller's) before the arena exists: a memset queued
  // there when it is allocated runs later, after the caller's own writes.
  CUDA_OK(gpusim::enqueue(nullptr, [] { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }));
  int k = -1;
  DDP_OK(ddp_register_grad(ddp, nullptr, 1024, DDP_F32, 0, &k));
  void* g = nullptr;
  DDP_OK(ddp_grad_ptr(ddp, k, &g));
  cudaStream_t us = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&us, cudaStreamNonBlocking));
  std::vector<float> host(1024, 3.0f), back(1024, 0.0f);
  CUDA_OK(cudaMemcpyAsync(g, host.data(), 1024 * sizeof(float), cudaMemcpyHostToDevice, us));
  DDP_OK(ddp_begin_backward(ddp, us));
  DDP_OK(ddp_grad_ready(ddp, k));
  DDP_OK(ddp_finish_backward(ddp, us));
  CUDA_OK(cudaMemcpyAsync(back.data(), g, 1024 * sizeof(float), cudaMemcpyDeviceToHost, us));
  CUDA_OK(cudaStreamSynchronize(us));
  CHECK(back[0] == 3.0f);
  CHECK(back[1023] == 3.0f);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaStreamDestroy(us));
  DDP_OK(ddp_destroy(ddp));
  DDP_OK(ddp_comm_destroy(comm));
}

GPU_TEST_CASE("gpusim ordering: the control path does not wait for the caller's blocking streams") {
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t busy = nullptr;
  CUDA_OK(cudaStreamCreate(&busy));  // blocking: the legacy stream waits for it
  CUDA_OK(gpusim::enqueue(busy, [] { std::this_thread::sleep_for(std::chrono::milliseconds(1500)); }));
  const auto t0 = std::chrono::steady_clock::now();
  {
    Ctx c(1, 1, DDP_LAYOUT_COPY, 60000);
    DDP_OK(ddp_commit(c.ddp));  // agreement over the control path
    CHECK(ms_since(t0) < 1000);
  }
  CUDA_OK(cudaStreamSynchronize(busy));
  CUDA_OK(cudaStreamDestroy(busy));
}

GPU_TEST_CASE("gpusim stalls: a later collective on the stream does not hide an earlier stuck one") {
  Ctx c(2, 1, DDP_LAYOUT_COPY, 400);
  NoFaultsAfter faults_off;
  gpusim::nccl_stall_collectives(true);
  const auto t0 = std::chrono::steady_clock::now();
  DDP_OK(ddp_begin_backward(c.ddp, nullptr));
  DDP_OK(ddp_grad_ready(c.ddp, c.index[1]));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  DDP_OK(ddp_grad_ready(c.ddp, c.index[0]));  // its deadline is 300 ms later than the first one's
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  ddp_status_t st = ddp_finish_backward(c.ddp, nullptr);
  gpusim::nccl_stall_collectives(false);
  CHECK(st == DDP_ERR_TIMEOUT);
  CHECK(has(ddp_last_error(), "bucket 0 of 2"));
  CHECK(has(ddp_last_error(), "rank 0 of 1"));
  CHECK(ms_since(t0) < 1500);
}

// Bucket 0 completes before the stall; bucket 1's collective is stuck. After the watchdog's abort
// releases it, its mark completes too: the timeout must still name bucket 1.
GPU_TEST_CASE("gpusim stalls: the bucket named by a timeout is the one whose collective did not complete") {
  Ctx c(2, 1, DDP_LAYOUT_COPY, 300);
  DDP_OK(ddp_begin_backward(c.ddp, nullptr));
  DDP_OK(ddp_grad_ready(c.ddp, c.index[1]));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // bucket 0 completes
  NoFaultsAfter faults_off;
  gpusim::nccl_stall_collectives(true);
  DDP_OK(ddp_grad_ready(c.ddp, c.index[0]));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ddp_status_t st = ddp_finish_backward(c.ddp, nullptr);
  gpusim::nccl_stall_collectives(false);
  CHECK(st == DDP_ERR_TIMEOUT);
  INFO(std::string(ddp_last_error()));
  CHECK(has(ddp_last_error(), "bucket 1 of 2"));
}

GPU_TEST_CASE("gpusim stalls: the watchdog aborts a stuck collective that the caller's own synchronize waits for") {
  Ctx c(1, 1, DDP_LAYOUT_COPY, 300);
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t us = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&us, cudaStreamNonBlocking));
  NoFaultsAfter faults_off;
  gpusim::nccl_stall_collectives(true);
  DDP_OK(ddp_begin_backward(c.ddp, us));
  DDP_OK(ddp_grad_ready(c.ddp, c.index[0]));
  DDP_OK(ddp_finish_backward(c.ddp, us));  // enqueued only: the deadline has not passed
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<bool> back{false};
  std::thread waiter([&] {
    cudaStreamSynchronize(us);  // no libddp call: only the watchdog can release it
    back = true;
  });
  while (!back && ms_since(t0) < 2000) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const bool released = back;
  gpusim::nccl_stall_collectives(false);
  CHECK(released);
  ddp_destroy(c.ddp);  // aborts what the watchdog did not
  c.ddp = nullptr;
  waiter.join();
  CUDA_OK(cudaStreamDestroy(us));
}

GPU_TEST_CASE("gpusim stalls: the communicators of every stream are aborted together, not one after another") {
  Ctx c(2, 2, DDP_LAYOUT_COPY, 300);
  NoFaultsAfter faults_off;
  gpusim::nccl_stall_collectives(true);
  DDP_OK(ddp_begin_backward(c.ddp, nullptr));
  DDP_OK(ddp_grad_ready(c.ddp, c.index[0]));
  DDP_OK(ddp_grad_ready(c.ddp, c.index[1]));  // stuck on both streams
  std::this_thread::sleep_for(std::chrono::milliseconds(350));
  const auto t0 = std::chrono::steady_clock::now();
  ddp_status_t st = ddp_finish_backward(c.ddp, nullptr);
  if (st == DDP_SUCCESS) st = ddp_synchronize(c.ddp);
  gpusim::nccl_stall_collectives(false);
  CHECK(st == DDP_ERR_TIMEOUT);
  CHECK(ddp_destroy(c.ddp) == DDP_SUCCESS);
  c.ddp = nullptr;
  CHECK(ms_since(t0) < 1500);  // one abort after the other waits on the sibling's spinning kernel
}

GPU_TEST_CASE("gpusim stalls: ddp_broadcast on NCCL is watched like the buckets") {
  Ctx c(1, 1, DDP_LAYOUT_COPY, 300);
  CUDA_OK(cudaSetDevice(0));
  void* buf = nullptr;
  CUDA_OK(cudaMalloc(&buf, 256 * sizeof(float)));
  void* const bufs[1] = {buf};
  const size_t counts[1] = {256};
  const ddp_dtype_t types[1] = {DDP_F32};
  NoFaultsAfter faults_off;
  gpusim::nccl_stall_collectives(true);
  DDP_OK(ddp_broadcast(c.ddp, bufs, counts, types, 1, 0, nullptr));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ddp_status_t st = ddp_broadcast(c.ddp, bufs, counts, types, 1, 0, nullptr);
  gpusim::nccl_stall_collectives(false);
  CHECK(st == DDP_ERR_TIMEOUT);
  CHECK(has(ddp_last_error(), "ddp_broadcast"));
  ddp_destroy(c.ddp);
  c.ddp = nullptr;
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaFree(buf));
}

GPU_TEST_CASE("gpusim guest: a thread that never set a device has no CUDA context after libddp calls") {
  ddp_comm_t comm = nullptr;
  std::thread([&] {
    ddp_nccl_id_t id;
    DDP_OK(ddp_nccl_get_unique_id(&id));
    DDP_OK(ddp_comm_init_nccl(&id, 1, 0, 1, &comm));  // on device 1
  }).join();
  bool before = true, after = true;
  ddp_status_t st = DDP_ERR_INTERNAL;
  std::thread([&] {
    before = gpusim::thread_has_context();
    ddp_config_t cfg;
    ddp_config_init(&cfg);
    ddp_t ddp = nullptr;
    st = ddp_create(comm, &cfg, &ddp);
    if (st == DDP_SUCCESS) st = ddp_destroy(ddp);
    after = gpusim::thread_has_context();  // restoring "device 0" would have made its context current
  }).join();
  CHECK(st == DDP_SUCCESS);
  CHECK(!before);
  CHECK(!after);
  ddp_comm_destroy(comm);
}

GPU_TEST_CASE("gpusim guest: a context's communicators are split sharing the parent's resources") {
  int splits0 = 0, shared0 = 0, splits1 = 0, shared1 = 0;
  gpusim::nccl_split_counts(&splits0, &shared0);
  {
    Ctx c(1, 3, DDP_LAYOUT_COPY, 60000);
    gpusim::nccl_split_counts(&splits1, &shared1);
  }
  CHECK(splits1 - splits0 == 5);  // control, broadcast, one per stream
  CHECK(shared1 - shared0 == 5);
}

GPU_TEST_CASE("gpusim capture: an iteration on a stream being captured is refused, and the context goes on") {
  Ctx c(1, 1, DDP_LAYOUT_COPY, 60000);
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t us = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&us, cudaStreamNonBlocking));
  gpusim::set_capturing(us, true);
  ddp_status_t st = ddp_begin_backward(c.ddp, us);
  gpusim::set_capturing(us, false);
  CHECK(st == DDP_ERR_UNSUPPORTED);
  CHECK(has(ddp_last_error(), "CUDA graph"));
  DDP_OK(ddp_begin_backward(c.ddp, us));
  DDP_OK(ddp_grad_ready(c.ddp, c.index[0]));
  gpusim::set_capturing(us, true);
  st = ddp_finish_backward(c.ddp, us);
  gpusim::set_capturing(us, false);
  CHECK(st == DDP_ERR_UNSUPPORTED);
  CUDA_OK(cudaStreamSynchronize(us));
  CUDA_OK(cudaStreamDestroy(us));
}
