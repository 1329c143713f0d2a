// Calling NCCL: the run-time lookup of its newer functions, its error texts, and the polls of a
// nonblocking communicator's calls against their deadlines.
#include "backends/cuda/nccl_calls.hpp"

#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>

namespace ddp {
namespace nccl {

static_assert(sizeof(ddp_nccl_id_t) == sizeof(ncclUniqueId), "ddp_nccl_id_t must hold an ncclUniqueId");

const NcclApi& api() {
  static NcclApi a;
  static std::once_flag once;
  std::call_once(once, [] {
    int v = 0;
    if (ncclGetVersion(&v) == ncclSuccess) a.version = v < 10000 ? (v / 1000) * 10000 + (v % 1000) : v;
    // The NCCL libddp was loaded with; RTLD_DEFAULT finds it too when NCCL was linked statically
    // into the program or loaded globally under another name.
    void* h = dlopen("libnccl.so.2", RTLD_LAZY | RTLD_NOLOAD);
    if (!h) h = dlopen("libnccl.so", RTLD_LAZY | RTLD_NOLOAD);
    void* scope = h ? h : RTLD_DEFAULT;
    a.comm_split = reinterpret_cast<decltype(a.comm_split)>(dlsym(scope, "ncclCommSplit"));
    a.premul_create = reinterpret_cast<decltype(a.premul_create)>(dlsym(scope, "ncclRedOpCreatePreMulSum"));
    a.op_destroy = reinterpret_cast<decltype(a.op_destroy)>(dlsym(scope, "ncclRedOpDestroy"));
    a.last_error = reinterpret_cast<decltype(a.last_error)>(dlsym(scope, "ncclGetLastError"));
    a.init_config = reinterpret_cast<decltype(a.init_config)>(dlsym(scope, "ncclCommInitRankConfig"));
    a.finalize = reinterpret_cast<decltype(a.finalize)>(dlsym(scope, "ncclCommFinalize"));
    if (h) dlclose(h);  // NOLOAD took a reference to the already loaded library; it stays loaded
    if (a.version < 21800) a.comm_split = nullptr;
    if (a.version < 21100) a.premul_create = nullptr, a.op_destroy = nullptr;
    if (a.version < 21400) a.init_config = nullptr, a.finalize = nullptr;  // no nonblocking communicators
  });
  return a;
}

const char* nccl_last_error(ncclComm_t comm) {
  const NcclApi& a = api();
  if (!a.last_error) return "";
  const char* s = a.last_error(comm);
  return s ? s : "";
}

void backoff(unsigned spin) {
  if (spin < 64)
    sched_yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(spin < 1024 ? 50 : 1000));
}

int64_t ms_left(Deadline dl) {
  if (dl.infinite()) return 0;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(dl.at() - std::chrono::steady_clock::now());
  return std::max<int64_t>(1, left.count());
}

ncclResult_t settle(ncclResult_t rc, ncclComm_t comm, Deadline dl) {
  if (rc != ncclInProgress || !comm) return rc;
  for (unsigned spin = 0;; ++spin) {
    ncclResult_t state = ncclInProgress;
    if (ncclResult_t q = ncclCommGetAsyncError(comm, &state)) return q;
    if (state != ncclInProgress || dl.passed()) return state;
    backoff(spin);
  }
}

// A call that was accepted (ncclInProgress) and then failed failed asynchronously: a nonblocking
// communicator's poll reports the error of a collective that already ran, as ncclCommGetAsyncError does.
void nccl_check(ncclResult_t rc, ncclComm_t comm, Deadline dl, const char* call) {
  const bool accepted = rc == ncclInProgress;
  rc = settle(rc, comm, dl);
  if (rc == ncclSuccess) return;
  if (rc == ncclInProgress)
    fail(DDP_ERR_TIMEOUT, "%s did not complete before the timeout: another rank stalled or died", call);
  const char* last = nccl_last_error(comm);
  fail(DDP_ERR_NCCL, "%s failed: %s%s%s%s", call, accepted ? "NCCL reported an asynchronous error: " : "",
       ncclGetErrorString(rc), last[0] ? ": " : "", last);
}

ncclDataType_t nccl_type(Dtype d) {
  switch (d) {
    case Dtype::F16: return ncclFloat16;
    case Dtype::BF16: return ncclBfloat16;
    case Dtype::F32: return ncclFloat32;
    case Dtype::F64: return ncclFloat64;
  }
  return ncclFloat32;
}

}  // namespace nccl
}  // namespace ddp
