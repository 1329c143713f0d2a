// Faults only the simulation can make (part of the gpusim build of the GPU tests): a collective that
// never completes (a peer that never arrives) and one that fails asynchronously. Both must surface
// at ddp_finish_backward with the right status and message, abort the context, and let ddp_destroy
// return; the stuck collective must be released by ncclCommAbort.
#include <chrono>
#include <string>

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
  }
  ~Rig() {
    ddp_destroy(ddp);
    ddp_comm_destroy(comm);
    cudaFree(grad);
  }
};

bool has(const char* text, const char* needle) { return std::string(text).find(needle) != std::string::npos; }

}  // namespace

GPU_TEST_CASE("gpusim faults: a collective that never completes times out, aborts, and destroy returns") {
  Rig rig(400);
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
  gpusim::nccl_fail_collectives(ncclRemoteError);
  DDP_OK(ddp_begin_backward(rig.ddp, nullptr));
  DDP_OK(ddp_grad_ready(rig.ddp, rig.index));
  // ddp_finish_backward does not wait on the host for GPU streams: it reports the error if the
  // collective has already failed, ddp_synchronize (which waits) reports it otherwise.
  ddp_status_t st = ddp_finish_backward(rig.ddp, nullptr);
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
