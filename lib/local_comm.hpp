// In-process ranks: N threads of one process that reduce through shared memory. The communicator of
// the unit tests (and of ddp_comm_init_self, a group of one); no MPI needed.
#pragma once

#include <memory>

#include "backend.hpp"

namespace ddp {

class LocalGroup;  // shared by the ranks; holds one channel per duplicate

std::shared_ptr<LocalGroup> make_local_group(int nranks);
int local_group_size(const LocalGroup& g);
std::unique_ptr<Comm> make_local_comm(std::shared_ptr<LocalGroup> group, int rank);

}  // namespace ddp
