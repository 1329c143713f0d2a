// The TCP store: a server that one process holds (rank 0's, or tools/ddp_store's for a job that must
// outlive every rank), and a client in every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "host/store.hpp"

namespace ddp {

// A client of the store at host:port, connecting until `dl` (the listening process may start later);
// `serve`: this process listens there first and serves the store for the client's life. `who` names
// the caller in messages ("rank 3"); *local: the address of this end of the connection.
std::shared_ptr<Store> open_tcp_store(const std::string& host, int port, bool serve, const std::string& who,
                                      Deadline dl, std::string* local);

// What a server did since it started, for tests and benchmarks (read from any thread).
struct StoreCounters {
  uint64_t requests = 0, bytes_in = 0, bytes_out = 0;
  uint64_t connections = 0, peak_connections = 0, open_connections = 0;  // accepted; most open at once; open now
  uint64_t wakeups = 0;                                                  // waiting requests looked at again
};
// "12 requests, 340 bytes in, ...": one line for a log.
std::string describe(const StoreCounters& c);

// The server alone, for a process that hosts a job's store for its whole life (tools/ddp_store; the
// ranks then set DDP_STORE_EXTERNAL=1): listens on `port` (0: any) from its construction until its
// destruction.
class StoreServer {
 public:
  explicit StoreServer(int port);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  int port() const;
  StoreCounters counters() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The requests this process's TCP store clients sent so far (all of them together).
uint64_t tcp_store_requests_sent();

}  // namespace ddp
