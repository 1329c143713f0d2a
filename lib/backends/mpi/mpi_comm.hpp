// The MPI communicator: host memory, Open MPI as the engine. An MPI collective cannot be cancelled.
// On a host stream's worker, a collective blocks and the thread that waits for the stream keeps the
// deadline (it writes the worker off if a peer never arrives); everywhere else a collective is issued
// nonblocking and polled against its deadline. Its parts: creation and duplicates (mpi_comm.cpp), the
// reductions over the ring (mpi_collectives.cpp), broadcasts and the control path (mpi_control.cpp).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "backends/mpi/mpi_ring_link.hpp"
#include "core/backend.hpp"
#include "host/host_device.hpp"
#include "host/ring.hpp"

namespace ddp {
namespace mpi {

// Counts larger than an int are sent in pieces.
constexpr size_t kMaxChunk = size_t(1) << 30;

class MpiComm final : public Comm {
 public:
  explicit MpiComm(MPI_Comm c);
  ~MpiComm() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::Host; }

  std::unique_ptr<Comm> dup() override;
  std::unique_ptr<Device> make_device() override { return std::unique_ptr<Device>(new HostDevice()); }
  std::unique_ptr<Prober> make_prober(std::function<Position()> mine) override;
  bool supports_wire(Dtype d) const override { return !is_16bit(d); }
  bool supports(RedOp op) const override { return op == RedOp::Sum || op == RedOp::SumScaled; }
  size_t buffer_bytes() const override { return ring_->bytes.load(); }
  size_t piece_elems(Dtype d, size_t bytes) const override {
    return std::max<size_t>(1, std::min(kMaxChunk, (bytes ? bytes : piece_bytes_) / dtype_size(d)));
  }

  void allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream&, Deadline dl) override;
  // The 16-bit wires on f32 buckets: the ring whenever every rank has a chunk (MPI has no 16-bit
  // arithmetic), else every rank's cast elements gathered and summed in rank order.
  bool can_cast_ring() const override { return true; }
  void allreduce_as(const void* send, void* recv, size_t n, Dtype d, Dtype wire, Reduction red, Stream&,
                    Deadline dl) override;
  void reduce_scatter(void* buf, size_t m, Dtype d, Reduction red, Stream&, Deadline dl) override;
  void allgather(void* buf, size_t bytes, Stream&, Deadline dl) override;
  void allgather_rounds(AllgatherRounds& rounds, Stream& s, Deadline dl) override;
  bool has_alltoall() const override { return true; }
  void alltoall(const void* send, void* recv, size_t bytes, Stream&, Deadline dl) override;

  // ddp_broadcast: the caller's buffers, in place.
  void broadcast(void* buf, size_t bytes, int root, void*, Deadline dl) override;
  void allgather_host(const void* in, void* out, size_t bytes, Deadline dl) override;
  void broadcast_host(void* buf, size_t bytes, int root, Deadline dl) override;

  // An MPI collective cannot be cancelled; the communicator is simply never used (or freed) again,
  // and the ring's buffer is kept for a message still on its way.
  void abort() override;

 private:
  MPI_Comm dup_within(Deadline dl);

  // One blocking call over the ring (defined with its only callers, in mpi_collectives.cpp).
  template <class F>
  void run_ring(F&& f, Deadline dl);
  void gathered_allreduce(host::RingBuffer& ring, const void* from, void* to, size_t k, Dtype d, double factor,
                          bool worker, Deadline dl);
  void mpi_allreduce(const void* from, void* to, size_t k, Dtype d, bool worker, Deadline dl);

  void bcast_pieces(char* p, size_t bytes, int root, Deadline dl);
  void control_wait(MPI_Request* req, Deadline dl, const char* what);
  void keep_control_buffers();

  MPI_Comm comm_;
  std::shared_ptr<host::RingBuffer> ring_;
  size_t piece_bytes_ = host::piece_bytes();
  int rank_ = 0, size_ = 1;
  bool aborted_ = false;
  std::vector<char> send_, recv_;  // control-path buffers (see allgather_host)
};

}  // namespace mpi
}  // namespace ddp
