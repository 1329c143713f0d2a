// The MPI communicator's broadcasts and its control path (agreement, plan, unused-grad report): small
// host messages, each a nonblocking collective polled against its deadline. The control path runs on
// buffers this comm owns, not on the callers' locals: a collective that timed out stays posted and
// writes into its buffer whenever the late rank arrives, so after a timeout those buffers are kept,
// never freed.
#include "backends/mpi/mpi_comm.hpp"

#include <cstring>

#include "backends/mpi/mpi_runtime.hpp"
#include "backends/mpi/mpi_wait.hpp"

namespace ddp {
namespace mpi {

void MpiComm::broadcast(void* buf, size_t bytes, int root, void*, Deadline dl) {
  if (root < 0 || root >= size_)
    fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size_ - 1);
  bcast_pieces(static_cast<char*>(buf), bytes, root, dl);
}

void MpiComm::allgather_host(const void* in, void* out, size_t bytes, Deadline dl) {
  if (bytes > kMaxChunk) fail(DDP_ERR_INTERNAL, "allgather of %zu bytes per rank", bytes);
  send_.assign(static_cast<const char*>(in), static_cast<const char*>(in) + bytes);
  recv_.resize(bytes * static_cast<size_t>(size_));
  MPI_Request req;
  DDP_MPI_CHECK(MPI_Iallgather(send_.data(), static_cast<int>(bytes), MPI_BYTE, recv_.data(), static_cast<int>(bytes),
                               MPI_BYTE, comm_, &req));
  control_wait(&req, dl, "MPI allgather");
  wire_bytes()->allgather(bytes, size_);
  if (bytes) std::memcpy(out, recv_.data(), recv_.size());
}

void MpiComm::broadcast_host(void* buf, size_t bytes, int root, Deadline dl) {
  if (root < 0 || root >= size_)
    fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size_ - 1);
  send_.assign(static_cast<const char*>(buf), static_cast<const char*>(buf) + bytes);
  try {
    bcast_pieces(send_.data(), bytes, root, dl);
  } catch (const Error& e) {
    if (e.status() == DDP_ERR_TIMEOUT) keep_control_buffers();
    throw;
  }
  if (bytes) std::memcpy(buf, send_.data(), bytes);
}

void MpiComm::bcast_pieces(char* p, size_t bytes, int root, Deadline dl) {
  for (size_t done = 0; done < bytes;) {
    size_t k = std::min(kMaxChunk, bytes - done);
    MPI_Request req;
    DDP_MPI_CHECK(MPI_Ibcast(p + done, static_cast<int>(k), MPI_BYTE, root, comm_, &req));
    wait_request(&req, dl, "MPI broadcast");
    wire_bytes()->broadcast(k, size_, rank_, root);
    done += k;
  }
}

void MpiComm::control_wait(MPI_Request* req, Deadline dl, const char* what) {
  try {
    wait_request(req, dl, what);
  } catch (const Error& e) {
    if (e.status() == DDP_ERR_TIMEOUT) keep_control_buffers();
    throw;
  }
}

void MpiComm::keep_control_buffers() {
  host::keep_until_exit(std::make_shared<std::vector<char>>(std::move(send_)));
  host::keep_until_exit(std::make_shared<std::vector<char>>(std::move(recv_)));
  send_ = std::vector<char>();
  recv_ = std::vector<char>();
}

}  // namespace mpi
}  // namespace ddp
