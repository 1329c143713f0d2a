// The host ring's neighbours over MPI point-to-point messages (host/ring.hpp runs the ring itself).
// On a stream worker a step is one blocking call (the thread that drains the stream keeps the
// deadline); elsewhere its sends and receives are nonblocking, polled against the deadline.
#pragma once

#include <mpi.h>

#include "backends/mpi/mpi_runtime.hpp"
#include "backends/mpi/mpi_wait.hpp"
#include "host/ring.hpp"

namespace ddp {
namespace mpi {

constexpr int kRingTag = 0x7ddb;

class MpiRingLink final : public host::RingLink {
 public:
  MpiRingLink(MPI_Comm c, int rank, int size, bool worker, Deadline dl)
      : comm_(c), rank_(rank), size_(size), worker_(worker), dl_(dl) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool worker() const { return worker_; }
  void exchange_with(int right, const void* out, size_t sn, int left, void* in, size_t rn) override {
    if (worker_) {
      DDP_MPI_CHECK(MPI_Sendrecv(out, static_cast<int>(sn), MPI_BYTE, right, kRingTag, in, static_cast<int>(rn),
                                 MPI_BYTE, left, kRingTag, comm_, MPI_STATUS_IGNORE));
      return;
    }
    post_with(right, out, sn, left, in, rn);
    wait_posted();
  }
  // Nonblocking halves; on a worker the wait blocks in MPI (no polling), elsewhere it polls against
  // the deadline.
  void post_with(int right, const void* out, size_t sn, int left, void* in, size_t rn) override {
    DDP_MPI_CHECK(MPI_Irecv(in, static_cast<int>(rn), MPI_BYTE, left, kRingTag, comm_, &req_[0]));
    DDP_MPI_CHECK(MPI_Isend(out, static_cast<int>(sn), MPI_BYTE, right, kRingTag, comm_, &req_[1]));
  }
  void wait_posted() override {
    if (worker_) {
      DDP_MPI_CHECK(MPI_Waitall(2, req_, MPI_STATUSES_IGNORE));
      return;
    }
    wait_request(&req_[0], dl_, "MPI ring allreduce (receive)");
    wait_request(&req_[1], dl_, "MPI ring allreduce (send)");
  }

 private:
  MPI_Comm comm_;
  int rank_, size_;
  bool worker_;
  Deadline dl_;
  MPI_Request req_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
};

}  // namespace mpi
}  // namespace ddp
