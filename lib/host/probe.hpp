// The stall inspector's exchange for host communicators without MPI under them (Gloo): each rank
// answers "where are you" on a TCP port of its own, from a thread that never blocks on the
// collectives, and an ask connects to every other rank at once, waiting at most its bound, so a dead
// or unreachable rank is simply "no answer".
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "host/store.hpp"
#include "core/backend.hpp"

namespace ddp {

// Collective over the `size` ranks that share `store`: each publishes its address under `key`,
// reads the others', then calls `barrier` (after which its key is no longer needed and is erased).
// `host` is this rank's address as the others reach it ("": the host name).
// One ask of the rank listening at host:port (request `seq`), bounded by `dl`: its position; or
// iteration -2 (the port refused: its process is gone), kAcceptedSilent (the port accepted but
// nothing answered: the process lives, stopped), -1 (no connection: dead host, cut link, or stuck).
Position ask_rank(const std::string& host, int port, uint64_t seq, Deadline dl);

std::unique_ptr<Prober> make_socket_prober(Store& store, const std::string& key, int rank, int size,
                                           const std::string& host, std::function<Position()> mine, Deadline dl,
                                           const std::function<void()>& barrier);

}  // namespace ddp
