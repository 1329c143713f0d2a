// The MPI communicator's creation from the program's MPI_Comm, its duplicates (one per bucket stream
// and for the prober) and its abort. Every duplication is bounded: MPI_Comm_idup, polled.
#include "backends/mpi/mpi_comm.hpp"

#include "backends/mpi/mpi_prober.hpp"
#include "backends/mpi/mpi_runtime.hpp"
#include "backends/mpi/mpi_wait.hpp"
#include "core/comms.hpp"
#include "core/knobs.hpp"

namespace ddp {
namespace mpi {

MpiComm::MpiComm(MPI_Comm c) : comm_(c), ring_(std::make_shared<host::RingBuffer>()) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

MpiComm::~MpiComm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !aborted_) MPI_Comm_free(&comm_);
}

std::unique_ptr<Comm> MpiComm::dup() { return std::unique_ptr<Comm>(new MpiComm(dup_within(creation_deadline()))); }

std::unique_ptr<Prober> MpiComm::make_prober(std::function<Position()> mine) {
  return mpi::make_prober(dup_within(creation_deadline()), std::move(mine));
}

void MpiComm::abort() {
  aborted_ = true;
  host::keep_until_exit(ring_);
}

MPI_Comm MpiComm::dup_within(Deadline dl) {
  try {
    return idup_within(comm_, dl, "create its context");
  } catch (const Error& e) {
    if (e.status() == DDP_ERR_TIMEOUT) aborted_ = true;  // out of step with its peers: never freed
    throw;
  }
}

}  // namespace mpi

std::unique_ptr<Comm> make_mpi_comm(const void* mpi_comm) {
  mpi::ensure_initialized();
  MPI_Comm base = mpi_comm ? *static_cast<const MPI_Comm*>(mpi_comm) : MPI_COMM_WORLD;
  if (base == MPI_COMM_NULL) fail(DDP_ERR_INVALID_ARGUMENT, "the MPI communicator is MPI_COMM_NULL");
  return std::unique_ptr<Comm>(
      new mpi::MpiComm(mpi::idup_within(base, Deadline::after_ms(knobs::init_timeout_ms()), "call ddp_comm_init_mpi")));
}

}  // namespace ddp
