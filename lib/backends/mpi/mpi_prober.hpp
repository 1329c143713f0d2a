// The stall inspector's exchange over MPI (see Prober in core/backend.hpp).
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>

#include "core/backend.hpp"

namespace ddp {
namespace mpi {

// A prober over `c`, a communicator of its own that it frees (or keeps, when a message was left
// posted); `mine` says where this rank is.
std::unique_ptr<Prober> make_prober(MPI_Comm c, std::function<Position()> mine);

}  // namespace mpi
}  // namespace ddp
