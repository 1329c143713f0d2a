// The TCP store: a server that one process holds (rank 0's, or tools/ddp_store's for a job that must
// outlive every rank), and a client in every rank.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "host/store.hpp"

namespace ddp {

// A client of the store at host:port, connecting until `dl` (the listening process may start later);
// `serve`: this process listens there first and serves the store for the client's life. `who` names
// the caller in messages ("rank 3"); *local: the address of this end of the connection.
std::shared_ptr<Store> open_tcp_store(const std::string& host, int port, bool serve, const std::string& who,
                                      Deadline dl, std::string* local);

// The server alone, for a process that hosts a job's store for its whole life (tools/ddp_store; the
// ranks then set DDP_STORE_EXTERNAL=1): listens on `port` (0: any), calls `listening` with the port
// bound, and serves until `stop` (polled every 100 ms) returns true.
void serve_store(int port, const std::function<void(int)>& listening, const std::function<bool()>& stop);

}  // namespace ddp
