// What the process's launcher says about its place, for the C shell (ddp_launcher_ranks). The core
// declares it; the host runtime defines it (lib/host/launcher_env.cpp, the init method "auto").
#pragma once

namespace ddp {

// This process's rank, the world size and its local rank (-1 when unknown), read from the
// environment as "auto" reads them; DDP_ERR_INVALID_ARGUMENT as "auto" refuses.
void launcher_ranks(int* rank, int* size, int* local_rank);

}  // namespace ddp
