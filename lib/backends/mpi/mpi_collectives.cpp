// The MPI communicator's reductions and gathers of bucket data. Allreduces of host pieces are
// libddp's ring (host/ring.hpp) over MPI point-to-point messages rather than MPI_Allreduce: averaging
// is folded into the last addition (a separate pass over a piece measured 25-55% of the allreduce's
// time on this engine) and every rank receives the same bits. Small ones stay MPI_Allreduce, whose
// algorithms suit latency-bound sizes better.
#include "backends/mpi/mpi_comm.hpp"

#include <algorithm>

#include "backends/mpi/mpi_runtime.hpp"
#include "backends/mpi/mpi_wait.hpp"

namespace ddp {
namespace mpi {

namespace {

// The ring: from this many bytes on (below, MPI_Allreduce and a scaling pass).
constexpr size_t kRingMinBytes = size_t(64) << 10;

MPI_Datatype mpi_type(Dtype d) {
  switch (d) {
    case Dtype::F32: return MPI_FLOAT;
    case Dtype::F64: return MPI_DOUBLE;
    default: fail(DDP_ERR_INTERNAL, "MPI has no %s arithmetic", dtype_name(d));
  }
}

}  // namespace

// One blocking call over the ring: a worker written off inside it parks when it returns, and a
// message left posted may still land in the ring's buffer, which is then kept.
template <class F>
void MpiComm::run_ring(F&& f, Deadline dl) {
  std::shared_ptr<host::RingBuffer> ring = ring_;
  host::BlockingCall call;
  MpiRingLink link(comm_, rank_, size_, call.on_worker(), dl);
  link.wire = wire_bytes();
  try {
    f(*ring, link);
  } catch (const Error& e) {
    if (e.status() == DDP_ERR_TIMEOUT) host::keep_until_exit(ring);
    throw;
  }
}

void MpiComm::allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream&, Deadline dl) {
  if (red.op != RedOp::Sum && red.op != RedOp::SumScaled) fail(DDP_ERR_INTERNAL, "MPI comm: only sums are fused");
  const double factor = red.op == RedOp::SumScaled ? red.factor : 1.0;
  const size_t es = dtype_size(d);
  if (size_ == 1) {
    host::convert(send, d, recv, d, n, factor);
    return;
  }
  // The whole call is one blocking call: a worker written off inside it parks when it returns.
  const size_t step = n * es >= kRingMinBytes ? host::kRingMaxBytes / es : kMaxChunk;
  run_ring(
      [&](host::RingBuffer& ring, MpiRingLink& link) {
        // A worker written off inside a blocking call below goes on here when it returns, after the
        // comm may be gone: past the first call, only the link, the ring and the caller's arguments.
        const int world = link.size();
        for (size_t done = 0; done < n;) {
          const size_t k = std::min(step, n - done);
          void* to = static_cast<char*>(recv) + done * es;
          const void* from = static_cast<const char*>(send) + done * es;
          if (k * es >= kRingMinBytes || (is_16bit(d) && k >= static_cast<size_t>(world))) {
            // MPI has no 16-bit arithmetic: a 16-bit wire (compression) always takes the ring.
            host::ring_allreduce(link, ring, from, to, k, d, factor);
          } else if (is_16bit(d)) {
            gathered_allreduce(ring, from, to, k, d, factor, link.worker(), dl);
            link.wire->allgather(k * es, world);
          } else {
            mpi_allreduce(send == recv ? MPI_IN_PLACE : from, to, k, d, link.worker(), dl);
            link.wire->allreduce(k * es, world);
            if (factor != 1.0) host::convert(to, d, to, d, k, factor);
          }
          done += k;
        }
      },
      dl);
}

// The 16-bit wires on f32 buckets (see the header).
void MpiComm::allreduce_as(const void* send, void* recv, size_t n, Dtype d, Dtype wire, Reduction red, Stream&,
                           Deadline dl) {
  if (d != Dtype::F32 || !is_16bit(wire)) fail(DDP_ERR_INTERNAL, "MPI comm: a cast ring takes f32 to a 16-bit wire");
  if (red.op != RedOp::Sum && red.op != RedOp::SumScaled) fail(DDP_ERR_INTERNAL, "MPI comm: only sums are fused");
  const double factor = red.op == RedOp::SumScaled ? red.factor : 1.0;
  const float* from = static_cast<const float*>(send);
  float* to = static_cast<float*>(recv);
  if (size_ == 1) return host::round_through(from, to, n, wire, factor);
  run_ring(
      [&](host::RingBuffer& ring, MpiRingLink& link) {
        for (size_t done = 0; done < n;) {
          const size_t k = std::min(host::kRingMaxBytes / dtype_size(wire), n - done);
          if (k >= static_cast<size_t>(link.size()))
            host::ring_allreduce_cast(link, ring, from + done, to + done, k, wire, factor);
          else
            host::gathered_allreduce_cast(link, ring, from + done, to + done, k, wire, factor);
          done += k;
        }
      },
      dl);
}

// Always the ring (libddp's own, as for large allreduces), on the bucket worker.
void MpiComm::reduce_scatter(void* buf, size_t m, Dtype d, Reduction red, Stream&, Deadline dl) {
  if (red.op != RedOp::Sum && red.op != RedOp::SumScaled) fail(DDP_ERR_INTERNAL, "MPI comm: only sums are fused");
  const double factor = red.op == RedOp::SumScaled ? red.factor : 1.0;
  char* p = static_cast<char*>(buf);
  if (size_ == 1) {
    host::convert(p, d, p, d, m, factor);
    return;
  }
  run_ring([&](host::RingBuffer& ring,
               MpiRingLink& link) { host::ring_reduce_scatter(link, ring, p, m, d, factor, piece_bytes_); },
           dl);
}

void MpiComm::allgather(void* buf, size_t bytes, Stream&, Deadline dl) {
  if (size_ == 1) return;
  run_ring([&](host::RingBuffer&, MpiRingLink& link) { host::ring_allgather(link, static_cast<char*>(buf), bytes); },
           dl);
}

void MpiComm::allgather_rounds(AllgatherRounds& rounds, Stream& s, Deadline dl) {
  if (size_ == 1) return Comm::allgather_rounds(rounds, s, dl);
  run_ring([&](host::RingBuffer&, MpiRingLink& link) { host::ring_allgather_rounds(link, rounds); }, dl);
}

void MpiComm::alltoall(const void* send, void* recv, size_t bytes, Stream&, Deadline dl) {
  run_ring(
      [&](host::RingBuffer&, MpiRingLink& link) {
        host::pairwise_alltoall(link, static_cast<const char*>(send), static_cast<char*>(recv), bytes);
      },
      dl);
}

// Fewer elements than ranks, of a type MPI cannot sum: every rank's elements to every rank, then a
// sum in rank order (the same bits everywhere).
void MpiComm::gathered_allreduce(host::RingBuffer& ring, const void* from, void* to, size_t k, Dtype d, double factor,
                                 bool worker, Deadline dl) {
  const size_t bytes = k * dtype_size(d);
  const int world = size_;  // read before the blocking call (see allreduce)
  char* all = ring.ensure(bytes * static_cast<size_t>(world));
  const int n = static_cast<int>(bytes);
  if (worker) {
    DDP_MPI_CHECK(MPI_Allgather(from, n, MPI_BYTE, all, n, MPI_BYTE, comm_));
  } else {
    MPI_Request req;
    DDP_MPI_CHECK(MPI_Iallgather(from, n, MPI_BYTE, all, n, MPI_BYTE, comm_, &req));
    wait_request(&req, dl, "MPI allgather");
  }
  host::convert(all, d, to, d, k, 1.0);
  for (int r = 1; r < world; ++r)
    host::sum_scaled(to, all + static_cast<size_t>(r) * bytes, to, k, d, r == world - 1 ? factor : 1.0);
}

void MpiComm::mpi_allreduce(const void* from, void* to, size_t k, Dtype d, bool worker, Deadline dl) {
  if (worker) {
    DDP_MPI_CHECK(MPI_Allreduce(from, to, static_cast<int>(k), mpi_type(d), MPI_SUM, comm_));
    return;
  }
  MPI_Request req;
  DDP_MPI_CHECK(MPI_Iallreduce(from, to, static_cast<int>(k), mpi_type(d), MPI_SUM, comm_, &req));
  wait_request(&req, dl, "MPI allreduce");
}

}  // namespace mpi
}  // namespace ddp
