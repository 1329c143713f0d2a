// The MPI entry point of a build without MPI: it says why it cannot work.
#include "core/comms.hpp"

namespace ddp {

std::unique_ptr<Comm> make_mpi_comm(const void*) {
  fail(DDP_ERR_UNSUPPORTED, "this libddp was built without MPI (MPI=0); rebuild with MPI=1");
}

}  // namespace ddp
