// The NCCL communicator's collectives on bucket streams and on the user's stream (ddp_broadcast), and
// NCCL groups: each call is enqueued under the communicator's lock and watched by the stream against
// its deadline; premultiplied-sum reductions are made once and kept.
#include "backends/cuda/nccl_comm.hpp"

#include "kernels/elementwise.h"

namespace ddp {
namespace nccl {

thread_local NcclComm::Group NcclComm::t_group;

void NcclComm::allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream& s, Deadline dl) {
  cudaStream_t cs = collective_stream(s, d);
  DeviceGuard g(device_);
  std::unique_lock<std::mutex> lock = hold();
  DDP_NCCL_RUN(ncclAllReduce(send, recv, n, nccl_type(d), op_for(red, d), comm_, cs), comm_, dl);
  in_group(dl);
  wire_bytes()->allreduce(n * dtype_size(d), size_);  // NCCL's algorithm is its own: the ring's formula
  s.watch(this, dl);
}

void NcclComm::reduce_scatter(void* buf, size_t m, Dtype d, Reduction red, Stream& s, Deadline dl) {
  cudaStream_t cs = collective_stream(s, d);
  DeviceGuard g(device_);
  std::unique_lock<std::mutex> lock = hold();
  void* mine = static_cast<char*>(buf) + static_cast<size_t>(rank_) * m * dtype_size(d);
  DDP_NCCL_RUN(ncclReduceScatter(buf, mine, m, nccl_type(d), op_for(red, d), comm_, cs), comm_, dl);
  in_group(dl);
  wire_bytes()->reduce_scatter(m * static_cast<size_t>(size_) * dtype_size(d), size_);
  s.watch(this, dl);
}

void NcclComm::allgather(void* buf, size_t bytes, Stream& s, Deadline dl) {
  cudaStream_t cs = collective_stream(s, Dtype::F32);
  DeviceGuard g(device_);
  std::unique_lock<std::mutex> lock = hold();
  const void* mine = static_cast<const char*>(buf) + static_cast<size_t>(rank_) * bytes;
  DDP_NCCL_RUN(ncclAllGather(mine, buf, bytes, ncclUint8, comm_, cs), comm_, dl);
  in_group(dl);
  wire_bytes()->allgather(bytes, size_);
  s.watch(this, dl);
}

void NcclComm::alltoall(const void* send, void* recv, size_t bytes, Stream& s, Deadline dl) {
  cudaStream_t cs = collective_stream(s, Dtype::F32);
  DeviceGuard g(device_);
  std::unique_lock<std::mutex> lock = hold();
  group_start();
  try {
    for (int j = 0; j < size_; ++j) {
      const size_t at = static_cast<size_t>(j) * bytes;
      DDP_NCCL_RUN(ncclSend(static_cast<const char*>(send) + at, bytes, ncclUint8, j, comm_, cs), comm_, dl);
      DDP_NCCL_RUN(ncclRecv(static_cast<char*>(recv) + at, bytes, ncclUint8, j, comm_, cs), comm_, dl);
    }
    in_group(dl);
  } catch (...) {
    try {
      group_end();
    } catch (...) {
    }
    throw;
  }
  group_end();
  wire_bytes()->alltoall(bytes, size_);
  s.watch(this, dl);
}

void NcclComm::broadcast(void* buf, size_t bytes, int root, void* user_stream, Deadline dl) {
  live();
  if (root < 0 || root >= size_)
    fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size_ - 1);
  DeviceGuard g(device_);
  cudaStream_t us = static_cast<cudaStream_t>(user_stream);
  std::unique_lock<std::mutex> lock = hold();
  DDP_NCCL_RUN(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, us), comm_, dl);
  wire_bytes()->broadcast(bytes, size_, rank_, root);
  watch_broadcast(us, dl);
}

void NcclComm::group_start() {
  DDP_NCCL_CHECK(ncclGroupStart(), nullptr);
  ++t_group.depth;
}
// A group may hold the collectives of several communicators (one per bucket stream); when NCCL
// answers ncclInProgress, every one of them is polled.
void NcclComm::group_end() {
  ncclResult_t rc = ncclGroupEnd();
  if (--t_group.depth > 0) return DDP_NCCL_CHECK(rc, nullptr);
  std::vector<GroupMember> members;
  members.swap(t_group.members);
  if (rc != ncclInProgress) return DDP_NCCL_CHECK(rc, comm_);
  for (const GroupMember& m : members) DDP_NCCL_RUN(rc, m.comm, m.deadline);
}

void NcclComm::in_group(Deadline dl) {
  if (t_group.depth == 0) return;
  for (const GroupMember& m : t_group.members)
    if (m.comm == comm_) return;
  t_group.members.push_back(GroupMember{comm_, dl});
}

// The CUDA stream under a bucket stream (the stream's own native handle: no type test).
cudaStream_t NcclComm::collective_stream(Stream& s, Dtype d) const {
  live();
  cudaStream_t cs = static_cast<cudaStream_t>(s.native());
  if (!cs) fail(DDP_ERR_INTERNAL, "NCCL comm: given a stream that is not a CUDA stream");
  if (!supports_wire(d))
    fail(DDP_ERR_UNSUPPORTED, "NCCL %d.%d has no %s arithmetic (2.10 or later has)", api().version / 10000,
         api().version / 100 % 100, dtype_name(d));
  return cs;
}

// The reduction for `red` on `d`: premultiplied sums are made once per (dtype, factor) and kept.
ncclRedOp_t NcclComm::op_for(Reduction red, Dtype d) {
  switch (red.op) {
    case RedOp::Sum: return ncclSum;
    case RedOp::Avg:
      if (!supports(RedOp::Avg)) fail(DDP_ERR_UNSUPPORTED, "ncclAvg needs NCCL 2.10 or later");
      return ncclAvg;
    case RedOp::PreMulSum: break;
    case RedOp::SumScaled: fail(DDP_ERR_INTERNAL, "NCCL comm: a scaled sum is not fused");
  }
  for (const auto& op : ops_)
    if (op.dtype == d && op.factor == red.factor) return op.op;
  if (!supports(RedOp::PreMulSum)) fail(DDP_ERR_UNSUPPORTED, "ncclRedOpCreatePreMulSum needs NCCL 2.11 or later");
  // The scalar has the collective's type: a 16-bit factor is rounded to 16 bits here.
  double f64 = red.factor;
  float f32 = static_cast<float>(red.factor);
  uint16_t f16 = d == Dtype::F16 ? elem::f32_to_f16(f32) : elem::f32_to_bf16(f32);
  void* scalar = d == Dtype::F64 ? static_cast<void*>(&f64) : d == Dtype::F32 ? static_cast<void*>(&f32) : &f16;
  ncclRedOp_t op;
  DDP_NCCL_CHECK(api().premul_create(&op, scalar, nccl_type(d), ncclScalarHostImmediate, comm_), comm_);
  ops_.push_back(PreMulOp{d, red.factor, op});
  return op;
}

}  // namespace nccl
}  // namespace ddp
