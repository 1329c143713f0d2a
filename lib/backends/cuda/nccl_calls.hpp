// Calling NCCL, for every file of the NCCL communicator: the functions newer than NCCL 2.10 (looked
// up at run time), the check of NCCL's return codes, and the wait for a nonblocking communicator's
// call (ncclInProgress) against a deadline.
#pragma once

#include <nccl.h>

#include <cstdint>

#include "core/backend.hpp"

namespace ddp {
namespace nccl {

void nccl_check(ncclResult_t rc, ncclComm_t comm, Deadline dl, const char* call);

// One macro for every NCCL return code: a call a nonblocking communicator answers with ncclInProgress
// is waited for until `dl` (DDP_ERR_TIMEOUT after it). `comm` (may be null) is the communicator the
// call works on; NCCL's last error text is added to the message.
#define DDP_NCCL_RUN(call, comm, dl) ::ddp::nccl::nccl_check((call), (comm), (dl), #call)
#define DDP_NCCL_CHECK(call, comm) ::ddp::nccl::nccl_check((call), (comm), ::ddp::Deadline::never(), #call)

// Functions newer than NCCL 2.10 are looked up at run time, so that the library still loads (and says
// what is missing) with an older libnccl.so.2.
struct NcclApi {
  int version = 0;  // ncclGetVersion: 10000*major + 100*minor + patch (2.9 and later)
  ncclResult_t (*comm_split)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) = nullptr;  // 2.18
  ncclResult_t (*premul_create)(ncclRedOp_t*, void*, ncclDataType_t, ncclScalarResidence_t,
                                ncclComm_t) = nullptr;                                        // 2.11
  ncclResult_t (*op_destroy)(ncclRedOp_t, ncclComm_t) = nullptr;                              // 2.11
  const char* (*last_error)(ncclComm_t) = nullptr;                                            // 2.13
  ncclResult_t (*init_config)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;  // 2.14
  ncclResult_t (*finalize)(ncclComm_t) = nullptr;                                             // 2.14
};
const NcclApi& api();

// NCCL's last error text for `comm` ("" before NCCL 2.13).
const char* nccl_last_error(ncclComm_t comm);

// A pause between polls: a yield at first, then sleeps that grow.
void backoff(unsigned spin);

// What is left of `dl` as a creation bound in milliseconds (0: none, as init_rank takes it).
int64_t ms_left(Deadline dl);

// A nonblocking communicator answers ncclInProgress while a call goes on in the background, and
// nothing else may be called on it until ncclCommGetAsyncError stops saying so. ncclInProgress here
// means `dl` passed first.
ncclResult_t settle(ncclResult_t rc, ncclComm_t comm, Deadline dl);

ncclDataType_t nccl_type(Dtype d);

}  // namespace nccl
}  // namespace ddp
